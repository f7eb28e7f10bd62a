"""Where minserve keeps files: its cache and the data it ships. Nothing here imports the rest of
minserve (nor torch), so the lowest layers (the kernel builder, the quantizers' calibration) can
ask without pulling in the engine's configuration or the evaluation code."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models, compiled kernels and machine probes live: ``$MINSERVE_CACHE``, else
    ``~/.cache/minserve`` (read at each call, so a test or ``minserve prepare`` can redirect it).
    An empty ``MINSERVE_CACHE=`` counts as unset: it must not become the current directory."""
    return Path(os.environ.get("MINSERVE_CACHE") or Path.home() / ".cache" / "minserve")


@contextlib.contextmanager
def cache_entry_lock(entry: str):
    """Hold ``$cache/.locks/<entry>.lock`` while this process fills the cache entry ``entry``.

    Processes that start together on a cold cache (a room of notebooks on a workshop box, the test
    suite's parts) otherwise each do the same work: SmolLM2's conversion is ~20 s of CPU, decode.c's
    compile another ~20. With the lock the first one does it and the others wait, then find it done
    (the caller checks again once it holds the lock). An advisory ``flock``: released by the kernel
    when its holder exits or dies. Where no lock can be had (no ``fcntl``, as on Windows; a cache or
    lock file this account cannot open) each process does the work itself, as without the lock."""
    try:
        import fcntl
        locks = cache_dir() / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        fd = os.open(locks / f"{entry}.lock", os.O_RDONLY | os.O_CREAT, 0o666)  # flock needs no write
    except (ImportError, OSError):
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logging.getLogger("minserve").info("waiting for another process preparing %s ...", entry)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:   # a file system without flock (some network mounts: ENOLCK): no lock
            pass
        yield
    finally:
        os.close(fd)   # closing the last descriptor releases the lock


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
