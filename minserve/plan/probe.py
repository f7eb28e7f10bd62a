"""Measure this machine's roofline: memory read bandwidth and matmul rates, cached once per machine.

Decode is bound by how fast weights stream from memory, so "this" machine's bandwidth is measured,
not looked up: ``torch.sum`` over a tensor far larger than the last-level cache reads every byte
once with all the threads PyTorch uses, which is the access pattern of a decode step's matmuls.
The best of a few runs is kept (the host is shared; the best run is the least disturbed one).

Results are stored in ``$MINSERVE_CACHE/probe/`` under a key of the CPU model, the GPU (if any),
the thread count and the torch version, so a later ``--hardware this`` reuses them. A read-only
cache (a prepared workshop box) is fine: the numbers are then kept only for this process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path

import torch

from minserve.config import cache_dir
from minserve.plan.hardware import Hardware

log = logging.getLogger("minserve")
_MEMO: dict[str, Hardware] = {}  # per process: a read-only cache must not mean re-probing each call


def cpu_model() -> str:
    """The CPU's marketing name where Linux shows it, else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def machine_key() -> str:
    """What the measurement depends on; a change of any part means measuring again."""
    dev = torch.cuda.get_device_name(0) if _device() == "cuda" else "cpu"
    return f"{cpu_model()} | {dev} | {torch.get_num_threads()} threads | torch {torch.__version__}"


def probe_path() -> Path:
    digest = hashlib.sha256(machine_key().encode()).hexdigest()[:16]
    return cache_dir() / "probe" / f"machine-{digest}.json"


def _best_time(fn, repeats: int) -> float:
    fn()  # warm up: page faults, allocator, kernel selection
    best = float("inf")
    for _ in range(repeats):
        if _device() == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if _device() == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: one ``sum`` over ``nbytes`` of float32 (much larger than caches)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=_device())
    return nbytes / _best_time(lambda: x.sum(), repeats)


def measure_matmul(dtype: torch.dtype, n: int = 2048, repeats: int = 3) -> float:
    """Dense matmul rate in FLOP/s: 2 n^3 for an n x n by n x n product."""
    a = torch.randn(n, n, device=_device()).to(dtype)
    b = torch.randn(n, n, device=_device()).to(dtype)
    return 2 * n**3 / _best_time(lambda: a @ b, repeats)


def measure_a8_products(rows: int = 1024, in_features: int = 2048, out: int = 2048,
                        repeats: int = 3) -> dict[str, float]:
    """The engine's int8-activation products (kernels/quant.py's ``linear_a8`` on weights laid out
    in tiles, as the engine does at load) at a prefill's size, in operations/s (2 per multiply-add),
    as ``{"w8a8_ops_per_s": ..., "w4a8_ops_per_s": ...}``; empty where those C loops are not built
    here (the torch reference that would answer instead is not what the engine runs)."""
    from minserve.kernels import quant as kq
    if _device() != "cpu" or kq.a8_isa() is None:
        return {}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=g)
    groups = in_features // 32
    weights = {8: (torch.randint(-127, 128, (out, in_features), generator=g, dtype=torch.int8),
                   torch.rand(out, generator=g) / 64, None, 0),
               4: (torch.randint(0, 256, (out, in_features // 2), generator=g, dtype=torch.uint8),
                   torch.rand(out, groups, generator=g) / 64, -torch.rand(out, groups, generator=g) / 8, 32)}
    rates = {}
    for bits, (codes, scales, mins, group_size) in weights.items():
        tiles = kq.a8_tiles(bits, codes, scales, mins, group_size)
        seconds = _best_time(lambda: kq.linear_a8(x, bits, codes, scales, mins, group_size, tiles=tiles), repeats)
        rates[f"w{bits}a8_ops_per_s"] = 2 * rows * in_features * out / seconds
    return rates


def _memory_bytes() -> int:
    """Memory the model and KV cache share here: the GPU's total, else the host's RAM."""
    if _device() == "cuda":
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def measure() -> dict:
    n = 4096 if _device() == "cuda" else 2048  # big enough to reach the BLAS steady state
    t0 = time.perf_counter()
    out = {"key": machine_key(), "memory_bytes": _memory_bytes(),
           "bandwidth_bytes_per_s": measure_bandwidth(),
           "fp32_flops_per_s": measure_matmul(torch.float32, n),
           "bf16_flops_per_s": measure_matmul(torch.bfloat16, n),
           "w8a8_ops_per_s": None, "w4a8_ops_per_s": None, **measure_a8_products(),
           "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    a8 = ", ".join(f"{out[k] / 1e9:.0f} GOP/s {k[:4].upper()}" for k in ("w8a8_ops_per_s", "w4a8_ops_per_s")
                   if out[k])
    log.info("measured this machine in %.1f s: %.1f GB/s read, %.0f GFLOP/s fp32, %.0f GFLOP/s bf16%s",
             time.perf_counter() - t0, out["bandwidth_bytes_per_s"] / 1e9, out["fp32_flops_per_s"] / 1e9,
             out["bf16_flops_per_s"] / 1e9, f", {a8}" if a8 else "")
    return out


def _save(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
    except OSError as e:
        log.info("cannot store the probe in %s (%s); it is kept for this process only", path, e)


def _load(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    # A probe stored before the int8-activation rates were measured (2026-12-07) is measured again.
    return data if data.get("key") == machine_key() and "w4a8_ops_per_s" in data else None


def this_machine(remeasure: bool = False) -> Hardware:
    """This machine as measured (the device the engine would use: CUDA if present, else CPU)."""
    path = probe_path()
    key = str(path)
    if not remeasure and key in _MEMO:
        return _MEMO[key]
    data = None if remeasure else _load(path)
    if data is None:
        data = measure()
        _save(path, data)
    dev = torch.cuda.get_device_name(0) if _device() == "cuda" else cpu_model()
    hw = Hardware(f"this ({dev}, {torch.get_num_threads()} threads)", int(data["memory_bytes"]),
                  float(data["bandwidth_bytes_per_s"]), float(data["bf16_flops_per_s"]),
                  float(data["fp32_flops_per_s"]), f"measured {data['measured_at']} ({path.name})",
                  _device(), data.get("w8a8_ops_per_s"), data.get("w4a8_ops_per_s"))
    _MEMO[key] = hw
    return hw
