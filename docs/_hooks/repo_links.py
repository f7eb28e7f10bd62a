"""MkDocs hook: links from the docs into the rest of the repository, for GitHub and the site alike.

A page links to code the way GitHub resolves links, relative to the page's own file, e.g.
``[Scheduler.schedule](../minserve/engine/scheduler.py#Scheduler.schedule)`` from ``docs/x.md``.
GitHub opens the file. On the site this hook does better, and checks what it can:

- the lab notebooks (``labs/NN_*.ipynb``) become pages of the site (mkdocs-jupyter renders them,
  unexecuted), so a link to one opens the rendered notebook;
- every other linked file gets a generated page under ``source/``: code with line numbers, or a
  Markdown file outside ``docs/`` (``benchmarks/README.md``) rendered as a page;
- an anchor naming a definition (``#Scheduler.schedule``, ``#plan``, a C function) becomes a link
  to its line, looked up when the site is built, so the link follows the code as lines move;
- a link to a file that does not exist, or to a name the file does not define, is a warning, which
  ``mkdocs build --strict`` turns into a failed build;
- the labs' own links (relative to ``labs/``) get the same treatment in their rendered pages.
"""

from __future__ import annotations

import ast
import json
import logging
import posixpath
import re
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files
from mkdocs.utils import get_relative_url

log = logging.getLogger("mkdocs.hooks.repo_links")

LINK = re.compile(r"(?<!!)\[([^\]\n]*)\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
HREF = re.compile(r'href="([^"]+)"')
SOURCE_DIR = "source"           # where the generated pages of repository files go on the site
LABS_GLOB = "labs/[0-9][0-9]_*.ipynb"
LANGUAGES = {".py": "python", ".c": "c", ".h": "c", ".sh": "bash", ".toml": "toml", ".yaml": "yaml",
             ".yml": "yaml", ".json": "json", ".jsonl": "json", ".ipynb": "json", "Makefile": "make"}

# Filled by on_files: repository path (posix, from the root) -> src_uri of its page on the site.
_site_path: dict[str, str] = {}
_root = Path(".")


def _outside_fences(markdown: str):
    """Yield (is_code, chunk): fenced code blocks are left alone (their links are examples)."""
    chunk, fence = [], None
    for line in markdown.splitlines(keepends=True):
        m = FENCE.match(line)
        if fence is None and m:
            yield False, "".join(chunk)
            chunk, fence = [line], m.group(1)
        elif fence is not None and m and m.group(1).startswith(fence[0] * len(fence)):
            chunk.append(line)
            yield True, "".join(chunk)
            chunk, fence = [], None
        else:
            chunk.append(line)
    yield fence is not None, "".join(chunk)


def _links(markdown: str) -> list[str]:
    return [m.group(2) for code, part in _outside_fences(markdown) if not code for m in LINK.finditer(part)]


def _repo_target(target: str, from_repo_path: str) -> tuple[str, str] | None:
    """(repository path, anchor) of a relative link written in the file ``from_repo_path``;
    None for links to the web, to this page, or absolute paths."""
    if re.match(r"[a-zA-Z][a-zA-Z+.-]*:", target) or target.startswith(("#", "/")):
        return None
    path, _, anchor = target.partition("#")
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(from_repo_path), path))
    return (None if resolved.startswith("..") else resolved), anchor


def _definition_line(path: Path, name: str) -> int | None:
    """Line of ``name`` (``Class.method``, a function, a module-level constant) in a Python file,
    or of a function defined at the start of a line in a C file."""
    if path.suffix != ".py":
        pattern = re.compile(rf"^\S.*\b{re.escape(name)}\s*\(")
        lines = path.read_text(encoding="utf-8").splitlines()
        return next((i for i, line in enumerate(lines, 1) if pattern.match(line)), None)
    body, line = ast.parse(path.read_text(encoding="utf-8")).body, None
    for part in name.split("."):
        node = next((n for n in body if _defines(n, part)), None)
        if node is None:
            return None
        body, line = getattr(node, "body", []), node.lineno
    return line


def _defines(node: ast.AST, name: str) -> bool:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == name
    return False


def _site_link(target: str, from_repo_path: str, where: str) -> str | None:
    """The link as the site needs it, relative to the page's src_uri (None: leave it as written).
    Problems are logged as warnings, which fail a strict build."""
    found = _repo_target(target, from_repo_path)
    if found is None or found[0] is None:
        return None
    path, anchor = found
    src_uri = path[len("docs/"):] if path.startswith("docs/") else _site_path.get(path)
    if src_uri is None:
        log.warning("%s links to %r: no such file in the repository", where, target)
        return None
    if anchor and path in _site_path and not path.endswith((".md", ".ipynb")):
        line = _definition_line(_root / path, anchor)
        if line is None:
            log.warning("%s links to %r: %s defines no %r", where, target, path, anchor)
            return None
        anchor = f"__codelineno-0-{line}"
    page_uri = _site_path.get(from_repo_path) or from_repo_path[len("docs/"):]
    link = posixpath.relpath(src_uri, posixpath.dirname(page_uri) or ".")
    return link + (f"#{anchor}" if anchor else "")


def _repo_path_of(page_src_uri: str) -> str:
    return next((p for p, uri in _site_path.items() if uri == page_src_uri), f"docs/{page_src_uri}")


def _source_page(path: str) -> str:
    """Markdown of a generated page: a Markdown file as itself, anything else as numbered code."""
    text = (_root / path).read_text(encoding="utf-8")
    if path.endswith(".md"):
        return text
    name = Path(path).name
    language = LANGUAGES.get(Path(path).suffix, LANGUAGES.get(name, "text"))
    fence = "`" * max(3, 1 + max((len(r) for r in re.findall(r"`+", text)), default=0))
    return f"# `{path}`\n\n{fence}{language} linenums=\"1\"\n{text.rstrip()}\n{fence}\n"


def _notebook_links(path: Path) -> list[str]:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return [t for c in cells if c["cell_type"] == "markdown" for t in _links("".join(c["source"]))]


@event_priority(100)  # before mkdocs-jupyter's on_files, which turns .ipynb files into pages
def on_files(files: Files, config) -> Files:
    global _root
    _root = Path(config.config_file_path).resolve().parent
    docs = Path(config.docs_dir).resolve()
    _site_path.clear()
    notebooks = sorted(_root.glob(LABS_GLOB))
    for nb in notebooks:
        rel = nb.relative_to(_root).as_posix()
        _site_path[rel] = rel
        files.append(File(rel, str(_root), config.site_dir, config.use_directory_urls))
    # Which repository files the pages link to (and, for Markdown files outside docs/ that become
    # pages themselves, what those link to).
    pending = [(f"docs/{p.relative_to(docs).as_posix()}", p.read_text(encoding="utf-8"))
               for p in docs.rglob("*.md")]
    pending += [(nb.relative_to(_root).as_posix(), "\n".join(f"[]({t})" for t in _notebook_links(nb)))
                for nb in notebooks]
    while pending:
        from_path, markdown = pending.pop()
        for target in _links(markdown):
            found = _repo_target(target, from_path)
            if not found or not found[0] or found[0].startswith("docs/") or found[0] in _site_path:
                continue
            path = found[0]
            if not (_root / path).is_file():
                continue  # reported when the page is rendered
            src_uri = f"{SOURCE_DIR}/{path}" + ("" if path.endswith(".md") else ".md")
            _site_path[path] = src_uri
            files.append(File.generated(config, src_uri, content=_source_page(path)))
            if path.endswith(".md"):
                pending.append((path, _source_page(path)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    from_path = _repo_path_of(page.file.src_uri)

    def rewrite(m: re.Match) -> str:
        link = _site_link(m.group(2), from_path, page.file.src_uri)
        return m.group(0) if link is None else f"[{m.group(1)}]({link})"

    return "".join(part if code else LINK.sub(rewrite, part) for code, part in _outside_fences(markdown))


LINE_ANCHOR = re.compile(r'<a id="(__codelineno-[0-9-]+)"')


def on_page_content(html: str, page, config, files) -> str:
    """A source page's line anchors made known to MkDocs' anchor check (highlighted code is raw
    HTML to it); the rendered notebooks' links, written relative to labs/, made into site URLs."""
    if page.file.src_uri.startswith(f"{SOURCE_DIR}/") and page.present_anchor_ids is not None:
        page.present_anchor_ids.update(LINE_ANCHOR.findall(html))
    if not page.file.src_uri.endswith(".ipynb"):
        return html
    from_path = page.file.src_uri

    def rewrite(m: re.Match) -> str:
        link = _site_link(m.group(1), from_path, from_path)
        if link is None:
            return m.group(0)
        path, _, anchor = link.partition("#")
        target = files.get_file_from_path(posixpath.normpath(posixpath.join(posixpath.dirname(from_path), path)))
        if target is None:
            log.warning("%s links to %r: not a page of the site", from_path, m.group(1))
            return m.group(0)
        url = get_relative_url(target.url, page.url)
        return f'href="{url}' + (f"#{anchor}" if anchor else "") + '"'

    return HREF.sub(rewrite, html)

