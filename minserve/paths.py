"""Where minserve keeps files: its cache and the data it ships. Nothing here imports the rest of
minserve (nor torch), so the lowest layers (the kernel builder, the quantizers' calibration) can
ask without pulling in the engine's configuration or the evaluation code."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models, compiled kernels and machine probes live: ``$MINSERVE_CACHE``, else
    ``~/.cache/minserve`` (read at each call, so a test or ``minserve prepare`` can redirect it).
    An empty ``MINSERVE_CACHE=`` counts as unset: it must not become the current directory."""
    return Path(os.environ.get("MINSERVE_CACHE") or Path.home() / ".cache" / "minserve")


def dataset_path(*parts: str) -> Path:
    """A path under the data that ships with minserve: the repository's ``datasets/`` in a checkout,
    ``minserve/datasets/`` in an installed wheel (pyproject.toml maps the one to the other, as it
    does kernels/). A checkout's own copy wins, as for the kernels; ``eval/prose.jsonl`` marks the
    directory as ours (Hugging Face's ``datasets`` package may sit beside an installed minserve)."""
    package = Path(__file__).resolve().parent
    for root in (package.parent / "datasets", package / "datasets"):
        if (root / "eval" / "prose.jsonl").is_file():
            return root.joinpath(*parts)
    return (package / "datasets").joinpath(*parts)   # missing: the readers' errors name this path
