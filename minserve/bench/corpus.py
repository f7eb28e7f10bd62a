"""An offline text corpus: the Python standard library's own documentation.

The scenario workloads need real prose and code-like text (not random tokens) so that tokenizers,
prefix caching and detokenization behave as they would on user traffic, and they must build on any
machine without a download. Every Python installation can render its modules' documentation with
``pydoc``, so the corpus is that text for a fixed list of modules.

Only the DESCRIPTION, CLASSES and FUNCTIONS sections are kept: the others hold install paths, URLs
with the Python version, version strings and live data values, which would make the corpus differ
from machine to machine. Given the same Python version, the corpus is identical everywhere.
"""

from __future__ import annotations

import functools
import importlib
import pydoc
import re
from dataclasses import dataclass

import numpy as np

# Pure-Python, stable, well-documented modules (about 0.8 MB of text, rendered in ~0.5 s).
CORPUS_MODULES: tuple[str, ...] = (
    "json", "collections", "functools", "pathlib", "shutil", "textwrap", "string", "heapq",
    "bisect", "statistics", "fractions", "datetime", "calendar", "csv", "difflib", "argparse",
    "dataclasses", "enum", "contextlib", "zipfile", "gzip", "queue", "urllib.parse",
    "email.message", "copy", "pprint", "glob", "fnmatch", "uuid", "ipaddress", "html",
    "configparser", "shlex", "sched", "graphlib", "numbers", "secrets", "timeit",
)
KEPT_SECTIONS = ("DESCRIPTION", "CLASSES", "FUNCTIONS")
_HEADER = re.compile(r"^([A-Z][A-Z ]+)$", re.M)       # pydoc section headers sit at column 0
# After dedenting, documented functions ("name(args)") and classes ("class Name(...)") start lines.
_NAME = re.compile(r"^(?:class )?([A-Za-z]\w*)\(", re.M)
_BLANK = re.compile(r"\n[ \t]*\n")                     # pydoc's blank lines carry indentation


@functools.lru_cache(maxsize=None)
def render_module(name: str) -> str:
    """The kept sections of ``pydoc``'s plain-text page for ``name``, dedented one level."""
    text = pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext)
    kept = []
    heads = list(_HEADER.finditer(text))
    for i, m in enumerate(heads):
        if m.group(1) in KEPT_SECTIONS:
            end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
            kept.append(text[m.end():end])
    body = "\n".join(kept)
    return "\n".join(line[4:] if line.startswith("    ") else line.strip() for line in body.splitlines())


@dataclass(frozen=True)
class Paragraph:
    module: str
    text: str


class Corpus:
    """Paragraphs of the documentation of :data:`CORPUS_MODULES`, plus the function names each
    module documents (for question templates). Passages are cut to an exact token count with the
    tokenizer the benchmark measures lengths with."""

    def __init__(self, tokenizer, modules: tuple[str, ...] = CORPUS_MODULES):
        self.tokenizer = tokenizer
        self.modules = modules
        self.paragraphs: list[Paragraph] = []
        self.functions: dict[str, list[str]] = {}  # public functions and classes per module
        for name in modules:
            page = render_module(name)
            for para in _BLANK.split(page):
                if len(para.split()) >= 4:  # drop headings and one-word fragments
                    self.paragraphs.append(Paragraph(name, para.strip("\n")))
            # Sorted so the names (and so the questions) do not depend on dict or set order.
            self.functions[name] = sorted(set(_NAME.findall(page))) or [name]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def count(self, text: str) -> int:
        """Tokens the server will count for ``text`` as a whole prompt (special tokens included)."""
        return len(self.tokenizer(text).input_ids)

    def cut(self, text: str, n_tokens: int) -> str:
        """The longest prefix of ``text`` that is ``n_tokens`` tokens (or all of it if shorter)."""
        ids = self.encode(text)[:max(n_tokens, 0)]
        # A cut inside a multi-byte character decodes to U+FFFD; drop that partial character.
        return self.tokenizer.decode(ids).rstrip("\ufffd")

    def passage(self, rng: np.random.Generator, n_tokens: int, module: str | None = None) -> str:
        """``n_tokens`` tokens of consecutive paragraphs, starting at a random paragraph
        (of ``module`` if given) and wrapping around the corpus if needed."""
        if n_tokens <= 0:
            return ""
        starts = ([i for i, p in enumerate(self.paragraphs) if p.module == module]
                  if module is not None else None) or range(len(self.paragraphs))
        i = int(starts[int(rng.integers(len(starts)))])
        parts, chars = [], 0
        # Documentation text runs about 3-4 characters per token; 6 leaves a safe margin.
        while chars < 6 * n_tokens + 64:
            parts.append(self.paragraphs[i % len(self.paragraphs)].text)
            chars += len(parts[-1]) + 2
            i += 1
        return self.cut("\n\n".join(parts), n_tokens)

    def fixed_text(self, modules: tuple[str, ...], n_tokens: int) -> str:
        """A seed-independent text of ``n_tokens`` tokens from the pages of ``modules``, used for
        content that must be byte-identical across requests and runs (shared instructions)."""
        text = "\n\n".join(render_module(m) for m in modules)
        while len(text) < 6 * n_tokens + 64:
            text += "\n\n" + text
        return self.cut(text, n_tokens)

    def pick_function(self, rng: np.random.Generator) -> tuple[str, str]:
        module = self.modules[int(rng.integers(len(self.modules)))]
        funcs = self.functions[module]
        return module, funcs[int(rng.integers(len(funcs)))]
