"""Causal prefill attention in C (kernels/prefill_attention.c), called from the PyTorch path.

A prefill chunk's attention is one sequence's queries [T, H, D] against its keys and values
[L, Hkv, D] (the cached context, then the chunk itself): two products that grow with T x L. PyTorch's
CPU flash SDPA runs them at about a quarter of this CPU's FMA rate; the C kernel is a flash
attention with register-blocked products and the keys transposed once, about twice as fast
(benchmarks/bench_roofline.py's kernel table).

:func:`prefill_attention` returns None whenever the kernel does not apply (neither float32 nor
bfloat16, a head size that is not a multiple of 64, a short chunk, no compiler), and the caller then
runs SDPA: the two compute the same attention up to rounding (tests/test_prefill_attention.py).
bfloat16 runs on AMX tiles where the CPU has them, and is widened to float32 elsewhere (below).
:func:`prefill_attention_paged` runs the same kernel on the paged KV cache in place, for several
sequences and any chunk length: each row's bits depend only on its query and keys, which the
engine's batch-invariant mode relies on (minserve/engine/batch_invariance.py).
``MINSERVE_PREFILL_ATTENTION=sdpa`` turns the kernel off, and kernels/paged_attention.py's for the
decode rows beside a chunk; ``=c`` (the default) uses them where they apply.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from minserve.kernels.build import KernelUnavailable, cpu_flags, env_choice, load
from minserve.kernels.decode import amx_wanted

# Below this many queries a chunk is a decode or a verification step, where SDPA's fixed cost is
# small and the C kernel's per-call work (transposing every key) is not repaid.
MIN_QUERY_LEN = 16
CHOICES = ("c", "sdpa")
# bfloat16 queries (a dtype="bfloat16" engine): on a CPU with AMX, both products run on its tiles
# (kernels/prefill_attention_amx.h; bf16 products summed in float32, the softmax in float32). Elsewhere
# they are widened to float32 for this kernel and the output rounded back: without AMX, PyTorch's
# bf16 SDPA is no faster than its fp32 one, and float32 sums are the more accurate of the two. With
# AMX but its tiles turned off (MINSERVE_AMX=off), bf16 goes to PyTorch's SDPA, which multiplies on
# the tiles itself (357 GFLOP/s against the float32 kernel's 147 on 1024 causal tokens,
# bench_roofline.py's kernel table on the Intel Xeon host, 2026-12-03).
INPUT_DTYPES = (torch.float32, torch.bfloat16)
_f32p = ctypes.POINTER(ctypes.c_float)
_u16p = ctypes.POINTER(ctypes.c_uint16)
_I64 = ctypes.c_int64
_P = ctypes.c_void_p


@functools.cache
def _routes_bf16_here() -> bool:
    """Whether bf16 chunks are better off in this file's kernels than in SDPA on this CPU: on the
    AMX tiles where it has them and they are on, widened to float32 where it has none."""
    return tiles_on() or "amx_bf16" not in cpu_flags()


@functools.cache
def tiles_on() -> bool:
    """Whether bf16 chunks run on AMX tiles here: the CPU has them, ``MINSERVE_AMX`` is not "off",
    and Linux granted this process the tile state."""
    lib = _library()
    return (lib is not None and "amx_bf16" in cpu_flags() and amx_wanted()
            and lib.ms_prefill_attention_amx() == 1)


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
    lib.ms_prefill_attention_bf16.restype = _I64
    lib.ms_prefill_attention_amx.restype = _I64
    lib.ms_prefill_attention_paged.restype = _I64
    lib.ms_prefill_attention_paged.argtypes = [_P, _P, _P, _P, _P, _I64, _I64, _P, _I64, _P, _I64, _I64,
                                               _I64, _I64, _I64, ctypes.c_float, _P, _I64]
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
    if q.dtype is torch.bfloat16 and tiles_on():
        # The entry reads raw bf16 bytes: keys and values in another dtype (an int8 cache's
        # dequantized float32) would be read as garbage, so they come to q's dtype first.
        return _call(_library().ms_prefill_attention_bf16, _u16p,
                     (q, keys.to(torch.bfloat16), values.to(torch.bfloat16)), T, H, Hkv, D, L,
                     scale, num_threads)
    out = _call(_library().ms_prefill_attention, _f32p, (q.float(), keys.float(), values.float()),
                T, H, Hkv, D, L, scale, num_threads)
    return out if out is None or q.dtype == torch.float32 else out.to(q.dtype)


def _call(entry, pointer, tensors, T, H, Hkv, D, L, scale, num_threads) -> torch.Tensor | None:
    """One C entry on contiguous copies of q, k, v (kept alive by the names below: the call reads
    raw pointers); its output [T, H, D] in their dtype, or None when it declined."""
    qc, kc, vc = (t.contiguous() for t in tensors)
    out = torch.empty_like(qc)
    ptr = lambda t: ctypes.cast(t.data_ptr(), pointer)  # noqa: E731
    rc = entry(ptr(qc), ptr(kc), ptr(vc), ptr(out), _I64(T), _I64(H), _I64(Hkv), _I64(D), _I64(L - T),
               ctypes.c_float(scale), _I64(max(0, int(num_threads))))
    return out if rc == 0 else None   # -1: shapes it does not take; -2: out of memory


def paged_available() -> bool:
    """Whether :func:`prefill_attention_paged` is built here (a C compiler, the switch at "c")."""
    return choice() == "c" and _library() is not None


def paged_applies(q: torch.Tensor, head_dim: int, k_cache: torch.Tensor) -> bool:
    """Whether :func:`prefill_attention_paged` takes queries ``q`` over this cache: float32 queries on
    the CPU, a float32 or int8 cache, a head size that is a multiple of 64, a built kernel."""
    return (q.device.type == "cpu" and q.dtype is torch.float32 and head_dim % 64 == 0
            and k_cache.dtype in (torch.float32, torch.int8) and paged_available())


def prefill_attention_paged(q: torch.Tensor, caches: tuple, tables: torch.Tensor, context_lens,
                            scale: float, num_threads: int = 0) -> torch.Tensor | None:
    """Causal attention of ``n`` sequences' queries ``q`` [n * T, H, D] (sequence i's at positions
    ``context_lens[i]`` .. + T - 1) over the paged ``caches`` = (k_cache, v_cache, k_scales,
    v_scales) through block tables ``tables`` [n, blocks] -> [n * T, H * D], or None when the
    kernel declines. Any T: each row gets the same bits whatever else is in the call (the
    batch-invariant mode's attention; tests/test_batch_invariance.py)."""
    k_cache, v_cache, k_scales, v_scales = caches
    n = tables.shape[0]
    rows, H, D = q.shape
    if n == 0 or rows % n or not paged_applies(q, D, k_cache):
        return None
    T = rows // n
    qc, tab = q.contiguous(), tables.to(torch.int64).contiguous()
    lens = torch.as_tensor(context_lens, dtype=torch.int64)   # a tensor (AttentionGroup's) is not copied
    if lens.numel() != n:
        raise ValueError(f"prefill_attention_paged: {lens.numel()} context lengths for {n} sequences")
    int8 = k_cache.dtype is torch.int8
    pools = (k_cache, v_cache) + ((k_scales, v_scales) if int8 else ())
    if any(t is None or not t.is_contiguous() or t.device.type != "cpu" for t in pools) or (
            int8 and (k_scales.dtype, v_scales.dtype) != (torch.float32, torch.float32)):
        return None   # the C code reads raw pointers: only the pool's own dense layout
    out = torch.empty_like(qc)
    ptr = lambda t: None if t is None else ctypes.c_void_p(t.data_ptr())  # noqa: E731
    rc = _library().ms_prefill_attention_paged(
        ptr(qc), ptr(k_cache), ptr(v_cache), ptr(k_scales if int8 else None), ptr(v_scales if int8 else None),
        int(int8), k_cache.shape[1], ptr(tab), tab.shape[1], ptr(lens), n, T, H, k_cache.shape[2], D,
        ctypes.c_float(scale), ptr(out), max(0, int(num_threads)))
    return out.view(rows, H * D) if rc == 0 else None
