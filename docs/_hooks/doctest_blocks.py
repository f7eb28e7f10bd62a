"""Griffe extension for the API reference: doctest lines (``>>> ...``) in a docstring become a
Python code block. The docstrings are written for ``help()`` and doctest, where ``>>>`` is plain
text; Markdown would read each ``>`` as a quotation. (mkdocs.yml names this file under the
mkdocstrings handler's ``extensions``.)"""

from __future__ import annotations

import re

import griffe

PROMPT = re.compile(r"^(?P<indent>\s*)(?:>>>|\.\.\.)(?: |$)")
DOCTEST_FLAG = re.compile(r"\s*# doctest:.*$")


def fence_doctests(text: str) -> str:
    out: list[str] = []
    block: list[str] = []
    indent = ""

    def close() -> None:
        if block:
            out.extend([f"{indent}```python", *block, f"{indent}```"])
            block.clear()

    for line in text.splitlines():
        m = PROMPT.match(line)
        if m and (block or line.lstrip().startswith(">>>")):
            if not block:
                indent = m.group("indent")
            block.append(indent + DOCTEST_FLAG.sub("", line[m.end():]))
            continue
        close()
        out.append(line)
    close()
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    def on_object(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)
