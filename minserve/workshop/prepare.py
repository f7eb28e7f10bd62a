"""``minserve prepare``: fill a model cache once, so participants' sessions only read it.

On a workshop box, one account (the organiser's) converts the default model, compiles every C
kernel for this CPU and measures the machine for ``minserve plan --hardware this``; the
participants' sessions point ``MINSERVE_CACHE`` at that directory, which they may not be able to
write. Loading a prepared model or kernel writes nothing (models/loader.py, kernels/build.py), so
a read-only cache works, and forty participants do not each spend 30 s converting the same GGUF.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODELS = ("smollm2-135m", "tiny-llama")


@dataclass
class Step:
    step: str
    status: str   # ok | warn | fail
    detail: str


@contextlib.contextmanager
def using_cache(path: str | Path | None):
    """Point MINSERVE_CACHE at ``path`` for the duration (the loader reads it at each call)."""
    if path is None:
        yield
        return
    old = os.environ.get("MINSERVE_CACHE")
    os.environ["MINSERVE_CACHE"] = str(Path(path).expanduser().resolve())
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MINSERVE_CACHE", None)
        else:
            os.environ["MINSERVE_CACHE"] = old


def _timed(step: str, fn) -> Step:
    t0 = time.perf_counter()
    try:
        detail = fn()
    except Exception as e:  # noqa: BLE001 - one failed step must not hide the others
        return Step(step, "fail", f"{type(e).__name__}: {e}")
    return Step(step, "ok", f"{detail} ({time.perf_counter() - t0:.1f} s)")


def _model(name: str) -> str:
    from minserve.models.loader import load_model
    loaded = load_model(name)  # converts on first use, then reads everything back as LLM would
    return str(loaded.path)


def _kernels() -> list[Step]:
    """Every C kernel, not only the fused decode step's: a read-only cache cannot build one later,
    and what a missing kernel runs (prefill attention, quantized products, the sampler's top-p
    filter, ...) would fall back to PyTorch, slower, for every participant."""
    from minserve.kernels.build import KernelUnavailable, build, kernel_names, load
    steps = []
    for name in kernel_names():
        t0 = time.perf_counter()
        try:
            path = build(name)
            load(name)
        except KernelUnavailable as e:  # the engine falls back to PyTorch: slower, not broken
            steps.append(Step(f"kernel {name}", "warn", f"{e} (what it runs falls back to PyTorch)"))
            continue
        steps.append(Step(f"kernel {name}", "ok", f"{path} ({time.perf_counter() - t0:.1f} s)"))
    return steps


def _probe() -> str:
    from minserve.plan.probe import probe_path, this_machine
    hw = this_machine()
    return f"{hw.bandwidth_bytes_per_s / 1e9:.1f} GB/s read -> {probe_path()}"


def share_read_only(root: Path) -> None:
    """Add read (and, for directories, search) permission for everyone under ``root``: the
    participants' accounts must read what the organiser's account wrote. Write bits are left
    as they are; ``chmod -R a-w`` is the organiser's choice (docs/workshop.md)."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames, ""]:
            p = Path(dirpath, name) if name else Path(dirpath)
            mode = p.stat().st_mode
            extra = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH
            if stat.S_ISDIR(mode) or mode & stat.S_IXUSR:
                extra |= stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH
            if mode & extra != extra:
                p.chmod(mode | extra)


def prepare(cache_dir: str | Path | None = None, models: tuple[str, ...] = DEFAULT_MODELS,
            kernel: bool = True, probe: bool = True) -> list[Step]:
    """Convert ``models``, build every C kernel and measure this machine into ``cache_dir``
    (default: ``$MINSERVE_CACHE`` or ``~/.cache/minserve``). Returns one :class:`Step` per item."""
    with using_cache(cache_dir):
        from minserve.config import cache_dir as current
        root = current()
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return [Step("cache", "fail", f"cannot create {root}: {e}")]
        steps = [_timed(f"model {m}", lambda m=m: _model(m)) for m in models]
        if kernel:
            steps += _kernels()
        if probe:
            steps.append(_timed("probe this machine", _probe))
        try:
            share_read_only(root)
            steps.append(Step("permissions", "ok", f"everyone may read {root}"))
        except OSError as e:
            steps.append(Step("permissions", "warn", f"could not make {root} readable by all: {e}"))
    return steps
