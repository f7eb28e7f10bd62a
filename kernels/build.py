"""Compile minserve's C kernels on first use and load them with ctypes.

The C sources ship inside the package, beside this file (the repository's top-level ``kernels/``,
installed and imported as ``minserve.kernels``: pyproject.toml maps it). The first process that
needs a kernel compiles it with the machine's C compiler for *this* CPU (``-march=native``: AVX-512
where there is one) into ``$MINSERVE_CACHE/kernels``, under a name that hashes the source, the flags, the
compiler and the CPU, so an edited source or a different machine never picks up a stale binary.
"The source" includes every file it pulls in with ``#include "..."`` (quant_dot.h, shared by
quant.c and decode.c): editing a header rebuilds every library that includes it.
Compiling is paid once per machine and source: decode.c takes ~20 s (its loops specialized per
weight format, batch pass and attention group), quant.c ~6 s, the others under a second (gcc 12,
-O3, the Intel Xeon host, 2026-12-06); later processes only load the file.

The library links the OpenMP runtime PyTorch already loaded (``libgomp.so.1``), so our parallel
loops and PyTorch's share one thread pool instead of fighting over the cores.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

from minserve.paths import cache_dir, cache_entry_lock

SOURCE_DIR = Path(__file__).resolve().parent  # <name>.c beside build.py, wherever the package is
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=fast",
         "-std=c11", "-shared", "-fPIC"]


class KernelUnavailable(RuntimeError):
    """The C kernels cannot be used here (no compiler, a failed build, ...); the message says why."""


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise KernelUnavailable("no C compiler found: install gcc (Debian: apt install gcc) or set CC")
    return cc


@functools.cache
def cpu_info(*fields: str) -> str:
    """The value of the first /proc/cpuinfo line naming one of ``fields`` ("flags", "vendor_id",
    ...), or "" where Linux does not list it (another OS, a field this CPU lacks)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() in fields:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The switch ``name`` from the environment, lower-cased: one of ``choices`` (the first is the
    default, also for an empty value); anything else is a ValueError naming the allowed values."""
    wanted = os.environ.get(name, choices[0]).strip().lower() or choices[0]
    if wanted not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {wanted!r}")
    return wanted


def cpu_flags() -> set[str]:
    """The CPU's feature flags ("avx512_bf16", "amx_bf16", ...; ARM's "Features"), or an empty set."""
    return set(cpu_info("flags", "Features").split())


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's feature flags where Linux lists them."""
    return cpu_info("flags", "Features") or platform.processor() + platform.machine()


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def source_files(name: str) -> list[Path]:
    """``<name>.c`` and every file it includes with ``#include "..."``, transitively (quoted
    includes resolve beside the including file, as the compiler looks first). System headers
    (``<...>``) are the compiler's, which the key covers through its version."""
    files, todo = [], [SOURCE_DIR / f"{name}.c"]
    while todo:
        path = todo.pop()
        if path in files:
            continue
        files.append(path)
        try:
            text = path.read_bytes()
        except OSError as e:
            raise KernelUnavailable(f"cannot read the kernel source {path}: {e}") from e
        todo += [path.parent / m.decode() for m in _LOCAL_INCLUDE.findall(text)]
    return files


def kernel_names() -> list[str]:
    """Every C kernel this package can build: the ``<name>.c`` files beside this one (each compiles
    on its own into ``lib<name>-<key>.so``; the ``.h`` files are parts of them)."""
    return sorted(p.stem for p in SOURCE_DIR.glob("*.c"))


def vendor_flags() -> list[str]:
    """Defines that depend on the CPU's maker rather than its features. ``MS_PREFETCH_L2`` on AMD:
    the software prefetches ahead of the decode step's weight and KV streams go into L2 there
    (kernels/quant_dot.h's PREFETCH_AHEAD says what that measured)."""
    return ["-DMS_PREFETCH_L2"] if cpu_info("vendor_id") == "AuthenticAMD" else []


def library_path(name: str) -> Path:
    """Where the compiled ``name`` kernel lives (or will live) for this source, compiler and CPU."""
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"the C compiler {cc!r} does not run: {e}") from e
    sources = [p.name.encode() + b"\0" + p.read_bytes() for p in source_files(name)]
    key = hashlib.sha256(b"\0".join([*sources, " ".join(FLAGS + vendor_flags()).encode(), version.encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    return cache_dir() / "kernels" / f"lib{name}-{key}.so"


def build(name: str) -> Path:
    """Compile ``<name>.c`` (beside this file) unless this exact build is cached; return its path."""
    out = library_path(name)
    if out.exists():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KernelUnavailable(f"cannot create the kernel cache {out.parent}: {e} (set MINSERVE_CACHE)") from e
    if not os.access(out.parent, os.W_OK):  # a read-only cache prepared for another CPU or source
        raise KernelUnavailable(f"the kernel cache {out.parent} is read-only and holds no {out.name}; "
                                "run `minserve prepare` with write access, or set MINSERVE_CACHE")
    with cache_entry_lock(f"kernels-{out.stem}"):   # processes starting together compile it once
        if out.exists():   # built by another process while this one waited
            return out
        return _compile(name, out)


def _compile(name: str, out: Path) -> Path:
    """Run the compiler into a temporary name beside ``out``, then rename it into place."""
    tmp = out.with_name(f"{out.stem}.{os.getpid()}.tmp.so")  # rename is atomic: no half-written .so
    cmd = [_compiler(), *FLAGS, *vendor_flags(), str(SOURCE_DIR / f"{name}.c"), "-o", str(tmp), "-lm"]
    # Said before it starts: a first engine otherwise sits silent for decode.c's ~20 s.
    logging.getLogger("minserve").info("compiling the %s kernel for this CPU into %s (once per machine "
                                       "and source; decode takes ~20 s) ...", name, out.parent)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"compiling {name}.c failed to run: {e}") from e
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise KernelUnavailable(f"compiling {name}.c failed ({' '.join(cmd)}):\n{done.stderr.strip()}")
    os.replace(tmp, out)
    return out


@functools.cache
def load(name: str) -> ctypes.CDLL:
    """The compiled kernel library ``name``, built on first use. Raises KernelUnavailable."""
    import torch  # noqa: F401  (loads PyTorch's libgomp first, so ours resolves to the same one)
    path = build(name)
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelUnavailable(f"cannot load {path}: {e}") from e
