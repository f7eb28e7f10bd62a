"""Every link a learner can click in a lab opens something: relative links resolve to files in the
repository (JupyterLab, started by `make lab` with the repository as its root, and Binder open them
in place; GitHub renders them as links into the tree), and anchors into Markdown files name a
heading that exists. Links to the web are not fetched (the tests run offline)."""

import re
from pathlib import Path

import pytest

from lab_sources import LABS, ROOT, lab_sources

jupytext = pytest.importorskip("jupytext")

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def heading_slugs(markdown: Path) -> set[str]:
    """GitHub's (and JupyterLab's) anchors of a Markdown file's headings."""
    slugs = set()
    for line in markdown.read_text(encoding="utf-8").splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            text = re.sub(r"[`*_]", "", m.group(1).strip().lower())
            slugs.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return slugs


def links_of(source: Path) -> list[str]:
    nb = jupytext.read(str(source))
    return [target for c in nb.cells if c.cell_type == "markdown" for target in LINK.findall(c.source)]


def test_the_link_finder_sees_links_and_anchors(tmp_path):
    assert links_of(LABS / "07_overload_and_goodput.py"), "no links found: the pattern is broken"
    md = tmp_path / "x.md"
    md.write_text("# Serving over HTTP\n## The `bench` client, step 2\ntext\n")
    assert heading_slugs(md) == {"serving-over-http", "the-bench-client-step-2"}


@pytest.mark.parametrize("source", lab_sources(), ids=lambda p: p.stem)
def test_every_relative_link_resolves(source):
    broken = []
    for target in links_of(source):
        if re.match(r"[a-z]+:", target):          # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (LABS / path).resolve() if path else source
        if path and not file.exists():
            broken.append(f"{target} (no file {file})")
        elif anchor and file.suffix == ".md" and anchor not in heading_slugs(file):
            broken.append(f"{target} (no heading #{anchor} in {file.name})")
        elif path and ROOT not in file.parents:
            broken.append(f"{target} (outside the repository: JupyterLab cannot open it)")
    assert not broken, f"{source.name}: broken links:\n  " + "\n  ".join(broken)
