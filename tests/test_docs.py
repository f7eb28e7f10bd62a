"""The documentation site builds with ``mkdocs build --strict``: a link to a missing page, file or
definition, an anchor that is gone, or an API reference that no longer resolves fails the build,
and so this test (``make test`` runs it; ``make docs-build`` is the same build by hand)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MKDOCS = Path(sys.executable).with_name("mkdocs")

pytestmark = pytest.mark.skipif(not MKDOCS.exists(), reason="mkdocs is not installed: pip install -e '.[docs]'")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = os.environ | {"NO_MKDOCS_2_WARNING": "1"}
    built = subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(out)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, "mkdocs build --strict failed:\n" + built.stdout + built.stderr
    return out


def test_the_site_builds_strict_with_every_page(site):
    for page in ("index.html", "getting-started/index.html", "architecture/index.html",
                 "extending/index.html", "performance/index.html", "reference/engine/index.html"):
        assert (site / page).is_file(), page
    labs = sorted(p.stem for p in (ROOT / "labs").glob("[0-9][0-9]_*.ipynb"))
    assert labs, "no labs found"
    for lab in labs:
        html = (site / "labs" / lab / "index.html").read_text(encoding="utf-8")
        assert "jp-Notebook" in html or "jupyter-wrapper" in html, f"lab {lab} was not rendered as a notebook"


def test_the_api_reference_is_generated_from_the_docstrings(site):
    html = (site / "reference" / "engine" / "index.html").read_text(encoding="utf-8")
    # mkdocstrings renders each object under an anchor of its path, with its docstring.
    assert 'id="minserve.LLM.generate"' in html and "Generate for one prompt or a list" in html
    assert 'id="minserve.LLMEngine.add_request"' in html


def test_links_into_the_code_open_its_source_at_the_definition(site):
    """The hook (docs/_hooks/repo_links.py) turns `file.py#Name` links into links to the line
    that defines Name, on a generated page of that file."""
    html = (site / "architecture" / "index.html").read_text(encoding="utf-8")
    source = ROOT / "minserve" / "engine" / "scheduler.py"
    line = next(i for i, text in enumerate(source.read_text().splitlines(), 1) if "def schedule(self)" in text)
    assert f'href="../source/minserve/engine/scheduler.py/#__codelineno-0-{line}"' in html
    page = (site / "source" / "minserve" / "engine" / "scheduler.py" / "index.html").read_text(encoding="utf-8")
    assert f'id="__codelineno-0-{line}"' in page
