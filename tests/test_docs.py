"""The documentation: the site builds with ``mkdocs build --strict`` (a link to a missing page, file
or definition, an anchor that is gone, or an API reference that no longer resolves fails it), and
every code block of README.md and docs/*.md runs as written, or, where it would start something
long-running, is checked the cheap way its marker names (tests/doc_blocks.py says how).
``make test`` runs this; ``make docs-build`` is the same build by hand."""

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from doc_blocks import (ROOT, Block, code_blocks, doc_files, flags_of, makefile_targets, script_flags,
                        shell_commands)

BIN = Path(sys.executable).parent
MKDOCS = BIN / "mkdocs"
ENV = os.environ | {"NO_MKDOCS_2_WARNING": "1", "MINSERVE_LOG_LEVEL": "WARNING"}
BLOCKS = [b for path in doc_files() for b in code_blocks(path)]
needs_mkdocs = pytest.mark.skipif(not MKDOCS.exists(), reason="mkdocs is not installed: pip install -e '.[docs]'")


def mkdocs_build(project: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(out)], cwd=project, env=ENV,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = mkdocs_build(ROOT, out)
    assert built.returncode == 0, "mkdocs build --strict failed:\n" + built.stdout + built.stderr
    return out


@needs_mkdocs
def test_the_site_builds_strict_with_every_page(site):
    for page in ("index.html", "getting-started/index.html", "architecture/index.html",
                 "extending/index.html", "performance/index.html", "reference/engine/index.html"):
        assert (site / page).is_file(), page
    labs = sorted(p.stem for p in (ROOT / "labs").glob("[0-9][0-9]_*.ipynb"))
    assert labs, "no labs found"
    for lab in labs:
        html = (site / "labs" / lab / "index.html").read_text(encoding="utf-8")
        assert "jp-Notebook" in html or "jupyter-wrapper" in html, f"lab {lab} was not rendered as a notebook"


@needs_mkdocs
def test_the_api_reference_is_generated_from_the_docstrings(site):
    html = (site / "reference" / "engine" / "index.html").read_text(encoding="utf-8")
    # mkdocstrings renders each object under an anchor of its path, with its docstring.
    assert 'id="minserve.LLM.generate"' in html and "Generate for one prompt or a list" in html
    assert 'id="minserve.LLMEngine.add_request"' in html


@needs_mkdocs
def test_links_into_the_code_open_its_source_at_the_definition(site):
    """The hook (docs/_hooks/repo_links.py) turns `file.py#Name` links into links to the line
    that defines Name, on a generated page of that file."""
    html = (site / "architecture" / "index.html").read_text(encoding="utf-8")
    source = ROOT / "minserve" / "engine" / "scheduler.py"
    line = next(i for i, text in enumerate(source.read_text().splitlines(), 1) if "def schedule(self)" in text)
    assert f'href="../source/minserve/engine/scheduler.py/#__codelineno-0-{line}"' in html
    page = (site / "source" / "minserve" / "engine" / "scheduler.py" / "index.html").read_text(encoding="utf-8")
    assert f'id="__codelineno-0-{line}"' in page


@needs_mkdocs
@pytest.mark.parametrize("link,problem", [
    ("../pkg/mod.py#Gone", "pkg/mod.py defines no 'Gone'"),
    ("../pkg/missing.py", "no such file in the repository"),
])
def test_a_link_to_a_missing_file_or_definition_fails_the_strict_build(tmp_path, link, problem):
    """The same hook on a two-file project: the link that resolves builds, a broken one does not."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("class Thing:\n    def run(self):\n        pass\n")
    (tmp_path / "docs").mkdir()
    hook = ROOT / "docs" / "_hooks" / "repo_links.py"
    (tmp_path / "mkdocs.yml").write_text(f"site_name: t\ntheme: mkdocs\nhooks: [{hook}]\n"
                                         "markdown_extensions: [pymdownx.highlight, pymdownx.superfences]\n"
                                         "not_in_nav: source/\n")
    page = tmp_path / "docs" / "index.md"
    page.write_text("# T\n\n[run](../pkg/mod.py#Thing.run)\n")
    good = mkdocs_build(tmp_path, tmp_path / "site")
    assert good.returncode == 0, good.stderr
    assert 'href="source/pkg/mod.py/#__codelineno-0-2"' in (tmp_path / "site" / "index.html").read_text()
    page.write_text(f"# T\n\n[run](../pkg/mod.py#Thing.run) [broken]({link})\n")
    bad = mkdocs_build(tmp_path, tmp_path / "site")
    assert bad.returncode != 0 and problem in bad.stderr, bad.stderr


# ---- every code block runs as written, or is checked the way its marker says -------------------

def test_the_block_finder_sees_markers_fences_and_commands(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("# X\n\n<!-- not run: starts a server -->\n```bash\nA=1 minserve serve \\\n"
                  "    --port 9 # why\nexport B=2\n```\n\n1. step\n\n   ```python\n   print(1)\n   ```\n")
    shell, py = code_blocks(md)
    assert (shell.lang, shell.marker, shell.why, shell.line) == ("bash", "not run", "starts a server", 4)
    assert shell_commands(shell.text) == [["minserve", "serve", "--port", "9"]]
    assert (py.lang, py.marker, py.text) == ("python", None, "print(1)\n")
    assert script_flags(ROOT / "benchmarks" / "bench_quant.py") >= {"--rows", "--reps"}


def test_every_block_says_what_it_is():
    unknown = [b.where for b in BLOCKS if b.lang not in ("python", "bash", "json", "text")]
    assert not unknown, f"blocks with no or an unknown language (use ```text for output): {unknown}"
    misplaced = [b.where for b in BLOCKS if b.marker == "output" and b.lang != "text"]
    assert not misplaced, misplaced


@pytest.fixture(scope="module")
def python_results(tmp_path_factory) -> dict[str, dict]:
    """Every Python block that runs, in one subprocess (blocks that appear twice, like the quick
    start in README.md and getting-started.md, run once)."""
    runnable = [b for b in BLOCKS if b.lang == "python" and b.marker is None]
    codes = list(dict.fromkeys(b.text for b in runnable))
    tmp = tmp_path_factory.mktemp("blocks")
    (tmp / "blocks.json").write_text(json.dumps(codes))
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "doc_blocks.py"), str(tmp / "blocks.json"),
                           str(tmp / "results.json")], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=900)
    results = json.loads((tmp / "results.json").read_text()) if (tmp / "results.json").exists() else []
    by_code = dict(zip(codes, results))
    missing = {"ok": False, "stdout": "", "error": "not reached:\n" + done.stdout[-2000:] + done.stderr[-4000:]}
    return {b.where: by_code.get(b.text, missing) for b in runnable}


PYTHON = [b for b in BLOCKS if b.lang == "python"]


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.where)
def test_python_block(block: Block, python_results):
    if block.marker is not None:   # not run: it must still be valid Python
        compile(block.text, block.where, "exec")
        return
    result = python_results[block.where]
    assert result["ok"], f"{block.where} failed:\n{result['stdout'][-2000:]}\n{result['error']}"


@functools.lru_cache(maxsize=None)   # `minserve serve --help` is asked by several blocks
def _help_text(words: tuple[str, ...]) -> str:
    done = subprocess.run([*words, "--help"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(words)} --help failed: {done.stderr[-2000:]}"
    return done.stdout


def _help(words: list[str]) -> str:
    return _help_text(tuple(words))


def _local(words: list[str]) -> list[str]:
    """The command with ``.venv/bin/`` meaning this interpreter's venv (the one running the tests)."""
    return [str(BIN / words[0][len(".venv/bin/"):]) if words[0].startswith(".venv/bin/") else words[0], *words[1:]]


def _program(words: list[str]) -> tuple[str, list[str], list[str]]:
    """(kind, the command that prints the help, the rest): kind is "minserve", "module",
    "script", "make", "lm_eval" or "unknown"."""
    exe = words[0].rsplit("/", 1)[-1]
    if exe == "minserve" or words[:3] in ([".venv/bin/python", "-m", "minserve.cli"], ["python", "-m", "minserve.cli"]):
        rest = words[1:] if exe == "minserve" else words[3:]
        sub = rest[:2] if rest[:2] == ["bench", "serve"] else rest[:1] if rest and not rest[0].startswith("-") else []
        return "minserve", [str(BIN / "minserve"), *sub], rest[len(sub):]
    if exe.startswith("python") and len(words) > 2 and words[1] == "-m":
        return "module", [sys.executable, "-m", words[2]], words[3:]
    if exe.startswith("python") and len(words) > 1 and words[1].endswith(".py"):
        return "script", [words[1]], words[2:]
    if exe == "lm_eval":
        sub = words[1:2] if len(words) > 1 and not words[1].startswith("-") else []
        return exe, [str(BIN / "lm_eval"), *sub], words[1 + len(sub):]
    if exe == "make":
        return exe, ["make"], words[1:]
    return "unknown", [], words


def _check_without_running(block: Block, words: list[str]) -> None:
    if block.marker == "not checked":  # another program, not installed here: the reason says which
        assert block.why, f"{block.where}: say why it is not checked"
        return
    kind, help_cmd, rest = _program(words)
    cmd = " ".join(words)
    if kind == "unknown":
        raise AssertionError(f"{block.where}: cannot check `{cmd}`; mark it <!-- not checked: why -->")
    elif kind == "make":
        targets = [w for w in rest if "=" not in w and not w.startswith("-")]
        assert set(targets) <= makefile_targets(), f"{block.where}: no such make target in `{cmd}`"
    elif kind == "script":
        script = ROOT / help_cmd[0]
        assert script.is_file(), f"{block.where}: no script {help_cmd[0]}"
        unknown = set(flags_of(rest)) - script_flags(script)
        assert not unknown, f"{block.where}: {help_cmd[0]} defines no {sorted(unknown)}"
    else:
        text = _help(help_cmd)
        unknown = [f for f in flags_of(rest) if not re.search(re.escape(f) + r"(?![\w-])", text)]
        assert not unknown, f"{block.where}: `{' '.join(help_cmd)} --help` lists no {unknown}"


def _run(block: Block, words: list[str]) -> str:
    kind, _, _ = _program(words)
    assert kind in ("minserve", "module"), (f"{block.where}: `{' '.join(words)}` cannot be run by the "
                                            "test; mark it <!-- not run: why --> or <!-- not checked: why -->")
    done = subprocess.run(_local(words), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{block.where}: `{' '.join(words)}` exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done.stdout


SHELL = [b for b in BLOCKS if b.lang == "bash"]


@pytest.mark.parametrize("block", SHELL, ids=lambda b: b.where)
def test_shell_block(block: Block):
    commands = shell_commands(block.text)
    assert commands, f"{block.where}: no command in the block"
    outputs = []
    for words in commands:
        if block.marker is None:
            outputs.append(_run(block, words))
        else:
            _check_without_running(block, words)
    expected = _output_block_after(block)
    if expected is not None:
        assert block.marker is None, f"{block.where}: an output block follows a block that is not run"
        got = [ln.rstrip() for ln in outputs[0].strip().splitlines()]
        assert got == [ln.rstrip() for ln in expected.text.strip().splitlines()], (
            f"{expected.where} is not what `{' '.join(commands[0])}` prints now:\n{outputs[0]}")


def _output_block_after(block: Block) -> Block | None:
    same = [b for b in BLOCKS if b.path == block.path]
    later = [b for b in same if b.line > block.line]
    return later[0] if later and later[0].marker == "output" else None


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "json"], ids=lambda b: b.where)
def test_json_block_parses(block: Block):
    json.loads(block.text)


def test_the_readme_links_open_on_github():
    """README.md is not part of the site (GitHub shows it): its relative links must resolve in the
    repository, and an anchor into a Markdown file must name one of its headings."""
    from test_lab_links import LINK, heading_slugs
    readme = ROOT / "README.md"
    targets = LINK.findall(readme.read_text(encoding="utf-8"))
    assert any(t.startswith("docs/") for t in targets), "the README links into docs/"
    broken = []
    for target in targets:
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in heading_slugs(file):
            broken.append(f"{target} (no such heading)")
    assert not broken, broken
    assert len(readme.read_text(encoding="utf-8").splitlines()) <= 200, "the README is a front page"


def test_doctest_lines_become_code_blocks_in_the_reference():
    sys.path.insert(0, str(ROOT / "docs" / "_hooks"))
    try:
        from doctest_blocks import fence_doctests
    finally:
        sys.path.remove(str(ROOT / "docs" / "_hooks"))
    text = "Load it.\n\n    >>> llm = LLM('x')   # doctest: +SKIP\n    >>> for o in out:\n    ...     print(o)\nDone."
    assert fence_doctests(text) == ("Load it.\n\n    ```python\n    llm = LLM('x')\n    for o in out:\n"
                                    "        print(o)\n    ```\nDone.")
