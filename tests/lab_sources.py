"""Each lab has one source: ``labs/NN_name.py`` in jupytext's py:percent format, paired with the
``labs/NN_name.ipynb`` that JupyterLab, Binder and nbval open. This module says whether a pair
has drifted apart, and clears a notebook's outputs (committed notebooks carry none).

``python tests/lab_sources.py check`` lists drifted pairs (exit 1 if any);
``python tests/lab_sources.py clear`` clears outputs and execution counts of every lab notebook.
``make labs-sync`` runs jupytext's ``--sync`` and then ``clear``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LABS = ROOT / "labs"


def lab_sources() -> list[Path]:
    return sorted(LABS.glob("[0-9][0-9]_*.py"))


def lab_notebooks() -> list[Path]:
    return sorted(LABS.glob("[0-9][0-9]_*.ipynb"))


def cells_of(path: Path) -> list[tuple[str, str]]:
    """(cell type, source) of every cell, as jupytext reads the file (either format)."""
    import jupytext
    nb = jupytext.read(str(path))
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def drift(source: Path) -> str | None:
    """None when ``source`` and its notebook hold the same cells, else what differs."""
    notebook = source.with_suffix(".ipynb")
    if not notebook.exists():
        return f"{notebook.name} is missing (make labs-sync writes it)"
    a, b = cells_of(source), cells_of(notebook)
    if a == b:
        return None
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return (f"cell {k} differs: {source.name} has {x[0]} {x[1][:80]!r}..., "
                    f"{notebook.name} has {y[0]} {y[1][:80]!r}...")
    return f"{source.name} has {len(a)} cells, {notebook.name} has {len(b)}"


def outputs_in(notebook: Path) -> list[int]:
    """Indices of code cells that carry outputs or an execution count."""
    import nbformat
    nb = nbformat.read(str(notebook), as_version=4)
    return [k for k, c in enumerate(nb.cells) if c.cell_type == "code"
            and (c.get("outputs") or c.get("execution_count") is not None)]


def clear(notebook: Path) -> bool:
    """Clear outputs and execution counts in place; True if the file changed."""
    import nbformat
    if not outputs_in(notebook):
        return False
    nb = nbformat.read(str(notebook), as_version=4)
    for c in nb.cells:
        if c.cell_type == "code":
            c.outputs, c.execution_count = [], None
    nbformat.write(nb, str(notebook))
    return True


def main(argv: list[str]) -> int:
    what = argv[1] if len(argv) > 1 else "check"
    if what == "clear":
        for nb in lab_notebooks():
            if clear(nb):
                print(f"cleared outputs of {nb.relative_to(ROOT)}")
        return 0
    bad = [(s, d) for s in lab_sources() if (d := drift(s))]
    for s, d in bad:
        print(f"{s.relative_to(ROOT)}: {d}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
