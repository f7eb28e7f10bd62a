"""Every lab is one py:percent source paired with its notebook: the pair must not drift, and the
committed notebook carries no outputs (tests/lab_sources.py; `make labs-sync` repairs both)."""

import pytest

from lab_sources import LABS, cells_of, drift, lab_notebooks, lab_sources, outputs_in

pytest.importorskip("jupytext")


def test_every_notebook_has_its_source_and_every_source_its_notebook():
    notebooks = {p.stem for p in lab_notebooks()}
    sources = {p.stem for p in lab_sources()}
    assert notebooks, "no lab notebooks found"
    assert notebooks == sources, (f"notebooks without a .py source: {sorted(notebooks - sources)}; "
                                  f"sources without a notebook: {sorted(sources - notebooks)}")
    assert not (LABS / "_build").exists(), "labs/_build generators are gone: the .py is the source"


@pytest.mark.parametrize("source", lab_sources(), ids=lambda p: p.stem)
def test_pair_has_not_drifted(source):
    assert drift(source) is None, drift(source)


@pytest.mark.parametrize("notebook", lab_notebooks(), ids=lambda p: p.stem)
def test_committed_notebook_has_no_outputs(notebook):
    assert outputs_in(notebook) == [], f"{notebook.name}: cells {outputs_in(notebook)} carry outputs"


def test_drift_is_detected(tmp_path):
    """The check itself can fail: an edited source no longer matches its notebook."""
    src = lab_sources()[0]
    copy_py, copy_nb = tmp_path / src.name, tmp_path / src.with_suffix(".ipynb").name
    copy_nb.write_text(src.with_suffix(".ipynb").read_text())
    copy_py.write_text(src.read_text().replace("# %% [markdown]", "# %% [markdown]\n# An edit.", 1))
    assert drift(copy_py) is not None
    assert len(cells_of(copy_py)) == len(cells_of(copy_nb))
