"""Tiny helper for the notebook generators in this folder: cells in, an outputs-free .ipynb out.

Each generator here (gen_NN_*.py) is the source of one lab notebook; run it to rewrite that
notebook (`.venv/bin/python labs/_build/gen_04_prefix_caching.py`).
The written notebook has no outputs and no execution counts, as committed notebooks must.
"""

from pathlib import Path
import textwrap

import nbformat

cells: list = []


def md(text: str) -> None:
    cells.append(nbformat.v4.new_markdown_cell(textwrap.dedent(text).strip("\n")))


def code(text: str) -> None:
    cells.append(nbformat.v4.new_code_cell(textwrap.dedent(text).strip("\n")))


def write(name: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = list(cells)
    nb.metadata = {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                                  "name": "python3"},
                   "language_info": {"name": "python"}}
    for k, c in enumerate(nb.cells):
        c.metadata = {}
        c.id = f"{Path(name).stem[:2]}-{k:03d}"  # stable ids: regenerating gives a clean diff
    nbformat.validate(nb)
    path = Path(__file__).resolve().parents[1] / name
    nbformat.write(nb, str(path))
    cells.clear()
    return path
