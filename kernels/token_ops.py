"""SwiGLU, RoPE and bfloat16 RMSNorm over many tokens in one C pass each (kernels/token_ops.c), for the PyTorch path.

A long prefill chunk spends about a fifth of its time in the element-wise operations between its
products once those run at the CPU's best rate: ``F.silu(gate) * up`` and RoPE's four operations
each pass over the whole chunk. The C versions make one pass each, threaded over rows.

Both functions return None (the caller then runs the PyTorch formula) unless the kernel applies:
a CPU tensor in float32 or bfloat16 with at least one row, the layout each expects, a compiler.
They apply at every row count, not only to long chunks: PyTorch's formula rounds differently (its
exp, no fused multiply-adds), so a threshold on rows made a request's bits depend on what shared
its step — a short prompt alone took PyTorch's SwiGLU and RoPE, the same prompt beside another
the C ones, and with int8 activations those last-bit differences round into other codes
(docs/engine/sampling.md, batch-invariant runs). Under 16 rows a call costs about what PyTorch's
does (SwiGLU + RoPE: 17.8-30.6 against 15.4-27.8 us at one row, 25.8-40.2 against 33.3-54.5 at
15; two runs of ``benchmarks/bench_batch_invariance.py --cost``, 2026-12-07).
``MINSERVE_TOKEN_OPS=torch`` turns them off; ``=c`` (the default) uses them where they apply.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from minserve.kernels.build import KernelUnavailable, env_choice, load

CHOICES = ("c", "torch")
_DTYPES = (torch.float32, torch.bfloat16)
_P, _I, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def choice() -> str:
    """``MINSERVE_TOKEN_OPS``: "c" (default) or "torch"; anything else is an error."""
    return env_choice("MINSERVE_TOKEN_OPS", CHOICES)


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = load("token_ops")
    except KernelUnavailable:
        return None
    lib.ms_silu_mul.restype = None
    lib.ms_silu_mul.argtypes = [_P, _I, _P, _I, _I, _INT, _INT]
    lib.ms_rope.restype = None
    lib.ms_rope.argtypes = [_P, _I, _I, _I, _I, _P, _P, _INT, _INT]
    lib.ms_rms_norm_bf16.restype = None
    lib.ms_rms_norm_bf16.argtypes = [_P, _I, _P, _P, _I, _I, ctypes.c_float, _INT]
    return lib


def _takes(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in _DTYPES and x.dim() >= 2 and x.shape[0] >= 1
            and choice() == "c" and _library() is not None)


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor | None:
    """``silu(gate_up[:, :inter]) * gate_up[:, inter:]`` -> [T, inter], or None (not taken)."""
    if not (_takes(gate_up) and gate_up.dim() == 2 and gate_up.stride(1) == 1
            and gate_up.shape[1] == 2 * inter):
        return None
    out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype)
    _library().ms_silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), gate_up.shape[0],
                           inter, int(gate_up.dtype is torch.bfloat16), 0)
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor | None:
    """Rotate ``x`` [T, heads, D] in place by the gathered tables ``cos``/``sin_signed`` [T, 1, D]
    (x's dtype) and return it, or None (not taken; x untouched). x's heads must be contiguous
    within a row (a column slice of a [T, n * D] product is: its row stride is free)."""
    if not (_takes(x) and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
            and x.shape[2] % 2 == 0 and x.shape[2] <= 512):
        return None
    T, heads, D = x.shape
    tables = [t.reshape(T, D) for t in (cos, sin_signed)]
    if any(t.dtype is not x.dtype or not t.is_contiguous() or t.shape != (T, D) for t in tables):
        return None
    _library().ms_rope(x.data_ptr(), x.stride(0), T, heads, D, tables[0].data_ptr(),
                       tables[1].data_ptr(), int(x.dtype is torch.bfloat16), 0)
    return x


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of bfloat16 rows ``x`` [T, dim] by the bf16 ``weight`` [dim], rounded as the PyTorch
    formula in minserve/models/layers.py rounds (twice), or None (not taken)."""
    if not (_takes(x) and x.dtype is torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1
            and weight.dtype is torch.bfloat16 and weight.is_contiguous() and weight.shape == (x.shape[1],)):
        return None
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    _library().ms_rms_norm_bf16(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(),
                                x.shape[0], x.shape[1], eps, 0)
    return out
