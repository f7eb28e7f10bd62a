"""The dense matrix product behind every :class:`~minserve.models.layers.Linear` on a CPU.

``F.linear`` on float32 CPU tensors goes to the BLAS PyTorch was built with (MKL in the x86
wheels). On the AMD EPYC this project runs on, MKL's sgemm reaches about 40 % of the fp32 FMA
ceiling, while oneDNN, also inside every x86 PyTorch build and reachable as
``torch.ops.mkldnn._linear_pointwise``, works on the plain weight tensor (no second copy in another
layout) and reaches about 90 % of it. One run of benchmarks/bench_roofline.py (FMA ceiling 526
GFLOP/s; MKL / oneDNN in GFLOP/s): 1024 rows x the model's matrices 211-216 / 474-484 (2.2-2.3x),
16 rows 127-133 / 232-257 (1.7-2.0x), the LM head (49152 x 576) at 1 row 8.1 / 22.2 and at 16
rows 65 / 177 (2.7x). Decode steps run in the fused C kernel, so here the one-row case is the
last token of a prefill going through the LM head: oneDNN takes that too.

The result is the same float32 product summed in another order: it differs from MKL's by float32
rounding (about 1e-6 relative), which the token-exact tests against transformers tolerate as
they tolerate any kernel's rounding.

Which one wins depends on the CPU's maker: MKL picks its fast code paths on Intel CPUs only. On the
Intel Xeon host (AVX-512, AMX; 2026-12-03), benchmarks/bench_roofline.py's kernel table gave at
1024 rows MKL 276-294 and oneDNN 264-267 GFLOP/s over the model's matrices (MKL 1.04-1.11x), and at
16 rows 84-116 against 81-87: there the default is MKL.

bfloat16 products with bf16 dot products in the CPU go to ``F.linear`` (oneDNN), except that on a
CPU with AMX those of 16 to 384 rows (mixed steps, their LM head, short prefill chunks) run on the
tiles in kernels/bf16_gemm.c, which reads the weight as it lies where oneDNN reorders it on every
call: 0.96-1.9x oneDNN's rate over SmolLM2's products there (kernels/bf16_gemm.py has the sweep).

A float32 engine at ``fp32_matmul_precision="high"`` passes each weight's two bf16 halves too, and
float32 products of 16 rows or more run as three bf16 products on the AMX tiles
(kernels/bf16_gemm.py's split_linear, ~16 mantissa bits: 1.8-3.4x MKL's float32 rate over SmolLM2's
products in benchmarks/bench_roofline.py's kernel table, with one 1.0x at 1024 rows of 576 -> 576).

``MINSERVE_GEMM=torch`` forces ``F.linear`` everywhere (to compare, or where oneDNN misbehaves);
``onednn`` uses oneDNN for every 2-D float32 CPU input; ``auto`` (the default) takes oneDNN except on
an Intel CPU. A PyTorch without oneDNN (an ARM or a minimal build) falls back to ``F.linear`` by
itself.

bfloat16 products need bf16 dot products in the CPU (AVX-512 BF16 or AMX) to be fast. Without them
(an AVX2-only laptop or EPYC) PyTorch emulates them: on the AVX2 EPYC (2026-12-04),
benchmarks/bench_roofline.py's kernel table gave oneDNN bf16 18-21 GFLOP/s against fp32's
153-182 at 1024 rows, and a ``dtype="bfloat16"`` engine prefilled at 77 tok/s against fp32's 473
(benchmarks/bench_vs_vllm.py). There, from ``WIDEN_MIN_ROWS`` input rows on, the weight is widened
to float32 a tile at a time (exact: a bf16 is the top half of a float32), multiplied by the
float32 product above, and the output rounded to bf16 once: the arithmetic of a bf16 GEMM (exact
products, float32 sums, one rounding), summed in another order.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

from minserve.kernels import bf16_gemm
from minserve.kernels.build import cpu_flags, cpu_info

log = logging.getLogger("minserve")

BACKENDS = ("auto", "onednn", "torch")
# From this many rows on, emulated bf16 products go through float32 tiles. On the AVX2 EPYC
# (2026-12-04, 2 threads; bf16 F.linear / widened, ms): 576 -> 3072 at 4 rows 0.84 / 1.05, 8 rows
# 1.69 / 1.17, 512 rows 95 / 13.9; the LM head 576 -> 49152 at 4 rows 11.7 / 15.0, 8 rows
# 23.8 / 15.0, 512 rows 1553 / 293. Below it the widening costs more than the products it speeds.
WIDEN_MIN_ROWS = 8
WIDEN_TILE_BYTES = 2 * 1024 * 1024   # float32 weight rows per tile: written, then read back from L2/L3


@functools.lru_cache(maxsize=None)
def backend() -> str:
    """``onednn`` or ``torch``: what float32 CPU products use in this process (decided once)."""
    wanted = _requested()
    if wanted not in BACKENDS:
        raise ValueError(f"MINSERVE_GEMM must be one of {', '.join(BACKENDS)}, got {wanted!r}")
    if wanted == "auto":
        wanted = "torch" if cpu_info("vendor_id") == "GenuineIntel" else "onednn"
    if wanted == "torch":
        return "torch"
    try:
        x, w = torch.ones(2, 8), torch.ones(4, 8)
        y = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        if not torch.equal(y, F.linear(x, w)):
            raise RuntimeError("oneDNN's product disagrees with F.linear on a 2x8 by 8x4 check")
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        log.info("float32 matmuls use F.linear (oneDNN's linear unavailable: %s)", e)
        return "torch"
    return "onednn"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           halves: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``: oneDNN for 2-D float32 CPU inputs with a contiguous weight,
    float32 tiles for bf16 ones of ``WIDEN_MIN_ROWS`` rows or more on a CPU without bf16 dot
    products, ``F.linear`` for everything else (other dtypes and devices, empty inputs).
    ``halves``: the float32 weight's bf16 halves (fp32_matmul_precision "high",
    layers.Linear.split_weight): float32 inputs of ``bf16_gemm.MIN_ROWS`` rows or more then run as
    three bf16 products on the AMX tiles (kernels/bf16_gemm.py's split_linear)."""
    if x.device.type != "cpu" or x.dim() != 2 or x.shape[0] == 0 or not weight.is_contiguous():
        return F.linear(x, weight, bias)
    if halves is not None and x.shape[0] >= bf16_gemm.MIN_ROWS and _requested() != "torch":
        y = bf16_gemm.split_linear(x, halves, bias)
        if y is not None:
            return y
    if x.dtype is torch.float32 and weight.dtype is torch.float32 and backend() == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    if x.dtype is torch.bfloat16 and weight.dtype is torch.bfloat16 and x.shape[0] >= WIDEN_MIN_ROWS:
        if not native_bf16():
            return _widened_bf16(x, weight, bias)
        if _requested() != "torch":
            y = bf16_gemm.linear(x, weight, bias)   # AMX tiles where the CPU has them
            if y is not None:
                return y
    return F.linear(x, weight, bias)


@functools.lru_cache(maxsize=None)
def _requested() -> str:
    return os.environ.get("MINSERVE_GEMM", "auto").strip().lower() or "auto"


@functools.lru_cache(maxsize=None)
def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX) and PyTorch's oneDNN
    uses it; without, bf16 products are emulated (see the module's docstring)."""
    try:
        supported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
    return supported and bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def _widened_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """bf16 ``x @ weight.T + bias`` through float32 tiles of the weight, rounded to bf16 once."""
    def widen(r0: int, r1: int, tile: torch.Tensor) -> None:
        tile.copy_(weight[r0:r1])
    y = tiled_linear(x.float(), widen, None if bias is None else bias.float(), *weight.shape,
                     tile_bytes=WIDEN_TILE_BYTES)
    return y.to(torch.bfloat16)


def tiled_linear(x: torch.Tensor, fill, bias: torch.Tensor | None, out: int, in_features: int,
                 *, tile_bytes: int) -> torch.Tensor:
    """float32 ``x [T, in] @ W.T + bias`` for a weight that exists only in another form: ``fill(r0,
    r1, tile)`` writes W's rows r0..r1 as float32 into ``tile``, ``tile_bytes`` at a time, and
    each tile goes through :func:`linear` while it is still in cache. So a float32 copy of the
    whole matrix (113 MB for SmolLM2's 49152 x 576 LM head) never exists or goes to DRAM.
    Used for bf16 weights here and for int8 / int4 ones (kernels/quant.py)."""
    rows = max(16, tile_bytes // (4 * in_features))
    if rows >= out:   # one tile holds the whole matrix: the product's own output, no copy
        tile = torch.empty(out, in_features)
        fill(0, out, tile)
        return linear(x, tile, bias)
    y = torch.empty(x.shape[0], out)
    tile = torch.empty(min(rows, out), in_features)
    for r0 in range(0, out, rows):
        r1 = min(r0 + rows, out)
        w = tile[: r1 - r0]
        fill(r0, r1, w)
        y[:, r0:r1] = linear(x, w, None if bias is None else bias[r0:r1])
    return y
