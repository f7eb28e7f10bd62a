"""bfloat16 products of many rows on AMX tiles (kernels/bf16_gemm.c), for the PyTorch path's
``linear`` (minserve/models/gemm.py) in a dtype="bfloat16" engine; and float32 products as three
bf16 ones (:func:`split_linear`) where PyTorch's float32 matmul precision is "high".

:func:`linear` returns None (the caller then runs ``F.linear``) unless the kernel applies: a CPU
with AMX whose tile state Linux grants, ``MINSERVE_AMX`` not "off", bfloat16 input and weight on
the CPU, ``MIN_ROWS`` to ``MAX_ROWS`` rows, input and output sizes that are multiples of 32, a
compiler. Fewer rows: decode steps run in the fused step, and a lone row (a prefill's last token
through the LM head) stays with oneDNN. More rows: oneDNN's own AMX product is as fast or faster
there (its reorder of the weights is repaid), and this kernel is no faster than the tiles allow.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from minserve.kernels.build import KernelUnavailable, cpu_flags, load
from minserve.kernels.decode import amx_wanted

# The rows it takes. A sweep over SmolLM2's products (576 -> 960 / 576 / 3072, 1536 -> 576) against
# bf16 F.linear on the Intel Xeon, 2026-12-06, after the panel order (bf16_gemm.c's panel_count),
# tiles / oneDNN time ratios, 11 alternating calls each: 16 rows 1.63-1.87, 64 rows 1.54-1.63,
# 128 rows 1.15-1.18, 192 rows 0.99-1.09, 256 rows 1.04-1.53, 384 rows 0.96-1.06, 512 rows
# 0.82-0.92, 1024 rows 0.75-1.43 (oneDNN slow at 576 outputs there, fast at 2048), 2048 rows
# 0.71-0.79. At 384 about even; a mixed step of a 256-token prompt and 15 decoding sequences (271
# rows) spent 11-19 % less in its products on the tiles than in oneDNN (cProfile, two alternating
# runs). Below 16 a block is mostly padding.
MIN_ROWS, MAX_ROWS = 16, 384
_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _library() -> ctypes.CDLL | None:
    if "amx_bf16" not in cpu_flags() or not amx_wanted():
        return None
    try:
        lib = load("bf16_gemm")
    except KernelUnavailable:
        return None
    lib.ms_bf16_gemm.restype = _I
    lib.ms_bf16_gemm.argtypes = [_P, _P, _P, _P, _I, _I, _I, _I]
    lib.ms_bf16_gemm_available.restype = _I
    lib.ms_bf16x3_gemm.restype = _I
    lib.ms_bf16x3_gemm.argtypes = [_P, _P, _P, _P, _P, _I, _I, _I, _I]
    return lib if lib.ms_bf16_gemm_available() == 1 else None


def available() -> bool:
    """Whether bf16 products run on the tiles in this process."""
    return _library() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """bfloat16 ``x [T, in] @ weight.T + bias`` -> [T, out], or None when the kernel does not apply."""
    T, out = x.shape[0], weight.shape[0]
    if not (x.dtype is torch.bfloat16 and weight.dtype is torch.bfloat16 and x.dim() == 2
            and MIN_ROWS <= T <= MAX_ROWS and x.shape[1] % 32 == 0 and out % 32 == 0
            and weight.dim() == 2 and weight.shape[1] == x.shape[1] and weight.is_contiguous()
            and x.device.type == "cpu" and weight.device.type == "cpu" and _library() is not None):
        return None
    xc = x.contiguous()
    b = None if bias is None else bias.to(torch.float32).contiguous()
    y = torch.empty(T, out, dtype=torch.bfloat16)
    rc = _library().ms_bf16_gemm(weight.data_ptr(), xc.data_ptr(), None if b is None else b.data_ptr(),
                                 y.data_ptr(), T, x.shape[1], out, 0)
    return y if rc == 0 else None


def split(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 weight as two bf16 tensors, ``weight ~= hi + lo``: hi is the weight rounded to bf16,
    lo the rest rounded again (16 of float32's 24 mantissa bits; relative error <= 2^-17)."""
    hi = weight.to(torch.bfloat16)
    return hi, (weight - hi.float()).to(torch.bfloat16)


def split_linear(x: torch.Tensor, halves: tuple[torch.Tensor, torch.Tensor],
                 bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """float32 ``x [T, in] @ (hi + lo).T + bias`` -> float32 [T, out] as ``hi xh + lo xh + hi xl``
    on the tiles (x split as :func:`split` splits the weight; ``lo xl`` is below the rest's
    rounding), or None when the kernel does not apply (the rules of :func:`linear`, float32 x, at
    least ``MIN_ROWS`` rows and no upper bound). Against MKL's float32 ``F.linear`` over SmolLM2's
    shapes (benchmarks/bench_roofline.py's kernel table, two runs on the Intel Xeon, 2026-12-06):
    1.9-2.7x at 1024 rows (once 1.0x, at 576 -> 576), 3.2-3.4x at 64, 1.8-2.3x at 16, 2.1x through
    the LM head at 16. PyTorch documents this algorithm under
    ``torch.set_float32_matmul_precision("high")``."""
    hi, lo = halves
    T, out = x.shape[0], hi.shape[0]
    if not (x.dtype is torch.float32 and x.dim() == 2 and T >= MIN_ROWS and x.shape[1] % 32 == 0
            and out % 32 == 0 and hi.shape[1] == x.shape[1] and x.device.type == "cpu"
            and _library() is not None):
        return None
    xc = x.contiguous()
    b = None if bias is None else bias.to(torch.float32).contiguous()
    y = torch.empty(T, out, dtype=torch.float32)
    rc = _library().ms_bf16x3_gemm(hi.data_ptr(), lo.data_ptr(), xc.data_ptr(),
                                   None if b is None else b.data_ptr(), y.data_ptr(), T, x.shape[1], out, 0)
    return y if rc == 0 else None
