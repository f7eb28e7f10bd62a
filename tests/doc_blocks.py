"""The fenced code blocks of README.md and docs/*.md, and how tests/test_docs.py checks each kind.

A block is run as written unless the HTML comment on the line above it says otherwise:

- ``<!-- not run: why -->``: it would start something long-running (a server, a benchmark, the
  whole suite). A Python block is compiled; each shell command is checked the cheap way: a
  ``minserve`` or ``python -m`` command's flags must appear in its ``--help``, a benchmark
  script must exist and define every flag used, a ``make`` target must exist in the Makefile.
- ``<!-- not checked: why -->``: a command of a program that is not ours and not installed here
  (vLLM's server, from its own venv). Used sparingly; the reason is the documentation.
- ``<!-- output of the ... above -->`` on a ``text`` block: what the previous shell block prints;
  the test runs that block and compares.

``text`` blocks are output or listings and are not run; a block without a language is refused, so
every block says what it is.
"""

from __future__ import annotations

import ast
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>not run|not checked|output)\b(?P<why>.*?)-->\s*$")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int          # 1-based line of the opening fence
    lang: str
    text: str
    marker: str | None  # "not run", "not checked", "output" or None
    why: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "_hooks" not in p.parts)
    return [ROOT / "README.md", *docs]


def code_blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m.group("indent"), m.group("fence")
        end = next((j for j in range(i + 1, len(lines))
                    if lines[j].strip().startswith(fence) and not lines[j].strip()[len(fence):].strip()), None)
        assert end is not None, f"{path}:{i + 1}: unclosed code fence"
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:end]]
        above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = MARKER.match(above)
        lang = m.group("info").strip().split()[0] if m.group("info").strip() else ""
        blocks.append(Block(path, i + 1, lang, "\n".join(body) + "\n",
                            mark.group("kind") if mark else None,
                            mark.group("why").strip(" :") if mark else ""))
        i = end + 1
    return blocks


def shell_commands(text: str) -> list[list[str]]:
    """Each command of a shell block as words: continuations joined, comments dropped, leading
    variable assignments (``A=1 B=2 cmd``) removed; assignment-only and ``export`` lines dropped."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words and ASSIGNMENT.match(words[0]):
            words.pop(0)
        if words and words[0] != "export":
            commands.append(words)
    return commands


def flags_of(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("--")]


def script_flags(script: Path) -> set[str]:
    """The option strings a script's argparse defines, read from its source without running it
    (``BooleanOptionalAction`` adds ``--no-`` forms)."""
    flags = set()
    for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            flags.update(n for n in names if n.startswith("-"))
            if any(k.arg == "action" and "BooleanOptional" in ast.unparse(k.value) for k in node.keywords):
                flags.update("--no-" + n[2:] for n in names if n.startswith("--"))
    return flags


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z][\w.-]*):", text, flags=re.M))


def run_python_blocks(blocks_json: str, results_json: str) -> None:
    """Run each block's code in a fresh namespace, one after another in this process (one
    interpreter start and one torch import for all of them), and write what happened to
    ``results_json``: per block, ok, its stdout, and the traceback of a failure. Called in a
    subprocess by tests/test_docs.py, from the repository root."""
    import contextlib
    import gc
    import io
    import json
    import traceback
    results = []
    for code in json.loads(Path(blocks_json).read_text()):
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(code, "<doc block>", "exec"), {"__name__": "__main__"})
            results.append({"ok": True, "stdout": out.getvalue()})
        except BaseException:  # noqa: BLE001 - reported, then the next block runs
            results.append({"ok": False, "stdout": out.getvalue(), "error": traceback.format_exc()})
        gc.collect()  # each block's engines (and their KV pools) go before the next one's
        Path(results_json).write_text(json.dumps(results))


if __name__ == "__main__":
    import sys
    run_python_blocks(sys.argv[1], sys.argv[2])
