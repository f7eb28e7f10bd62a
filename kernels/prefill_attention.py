"""Causal prefill attention in C (kernels/prefill_attention.c), called from the PyTorch path.

A prefill chunk's attention is one sequence's queries [T, H, D] against its keys and values
[L, Hkv, D] (the cached context, then the chunk itself): two products that grow with T x L. PyTorch's
CPU flash SDPA runs them at about a quarter of this CPU's FMA rate; the C kernel is a flash
attention with register-blocked products and the keys transposed once, about twice as fast
(benchmarks/bench_roofline.py's kernel table).

:func:`prefill_attention` returns None whenever the kernel does not apply (not float32, a head
size that is not a multiple of 64, a short chunk, no compiler; bfloat16 is widened to float32), and the caller then runs SDPA: the
two compute the same attention up to float rounding (tests/test_prefill_attention.py).
``MINSERVE_PREFILL_ATTENTION=sdpa`` turns the kernel off; ``=c`` (the default) uses it where it applies.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from minserve.kernels.build import KernelUnavailable, cpu_flags, env_choice, load

# Below this many queries a chunk is a decode or a verification step, where SDPA's fixed cost is
# small and the C kernel's per-call work (transposing every key) is not repaid.
MIN_QUERY_LEN = 16
CHOICES = ("c", "sdpa")
# bfloat16 queries (a dtype="bfloat16" engine) are widened to float32 for the kernel and the output
# rounded back: without AMX, PyTorch's bf16 SDPA is no faster than its fp32 one, and float32 sums are
# the more accurate of the two. With AMX (bf16 tile products), PyTorch's bf16 flash SDPA multiplies
# on the tiles: 357 GFLOP/s against this kernel's 147 on 1024 causal tokens (bench_roofline.py's
# kernel table on the Intel Xeon host, 2026-12-03), so there bf16 goes to SDPA.
INPUT_DTYPES = (torch.float32, torch.bfloat16)
_f32p = ctypes.POINTER(ctypes.c_float)
_I64 = ctypes.c_int64


@functools.cache
def _routes_bf16_here() -> bool:
    """Whether bf16 chunks are better off in this kernel than in SDPA on this CPU (no AMX)."""
    return "amx_bf16" not in cpu_flags()


def choice() -> str:
    """``MINSERVE_PREFILL_ATTENTION``: "c" (default) or "sdpa"; anything else is an error."""
    return env_choice("MINSERVE_PREFILL_ATTENTION", CHOICES)


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = load("prefill_attention")
    except KernelUnavailable:
        return None   # no compiler or a failed build: SDPA, as before the kernel existed
    lib.ms_prefill_attention.restype = _I64
    return lib


def _takes(q: torch.Tensor, head_dim: int) -> bool:
    """Whether the kernel can take queries ``q`` [T, H, D] (dtype, device, sizes, the switch)."""
    return (q.device.type == "cpu" and q.dtype in INPUT_DTYPES and head_dim % 64 == 0
            and q.shape[0] >= MIN_QUERY_LEN and choice() == "c" and _library() is not None)


def applies(q: torch.Tensor, head_dim: int) -> bool:
    """Whether the attention backend should send queries ``q`` [T, H, D] here rather than to SDPA:
    the kernel takes them, and (for bfloat16) this CPU has no AMX to make SDPA the faster one."""
    return _takes(q, head_dim) and (q.dtype is torch.float32 or _routes_bf16_here())


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                      num_threads: int = 0) -> torch.Tensor | None:
    """Causal attention of queries [T, H, D] at positions L - T .. L - 1 over keys/values
    [L, Hkv, D] -> [T, H, D], or None when the kernel does not apply."""
    if not _takes(q, q.shape[-1]):
        return None
    T, H, D = q.shape
    L, Hkv = keys.shape[0], keys.shape[1]
    if keys.shape != (L, Hkv, D) or values.shape != keys.shape or L < T or H % Hkv:
        raise ValueError(f"prefill_attention: q {tuple(q.shape)}, keys {tuple(keys.shape)}, "
                         f"values {tuple(values.shape)}: want [T, H, D] and [L >= T, Hkv | H, D]")
    # Named locals: the C call reads raw pointers, so every tensor must outlive it.
    qc, kc, vc = (t.to(torch.float32).contiguous() for t in (q, keys, values))
    out = torch.empty_like(qc)
    ptr = lambda t: ctypes.cast(t.data_ptr(), _f32p)  # noqa: E731
    rc = _library().ms_prefill_attention(ptr(qc), ptr(kc), ptr(vc), ptr(out), _I64(T), _I64(H),
                                         _I64(Hkv), _I64(D), _I64(L - T), ctypes.c_float(scale),
                                         _I64(max(0, int(num_threads))))
    if rc != 0:   # -1: shapes it does not take; -2: out of memory
        return None
    return out if q.dtype == torch.float32 else out.to(q.dtype)
