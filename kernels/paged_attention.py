"""The fused decode step's attention (kernels/decode_attention.h) for the PyTorch path's decode rows.

A mixed step (a prompt chunk beside sequences that decode) runs on the PyTorch path, and its decode
rows' attention used to gather a copy of each sequence's KV blocks and hand them to SDPA, twice a
layer. This entry reads the paged cache in place, as the fused step does for a decode-only step,
in the cache's own format (float32, bfloat16 or int8 codes with their scales): the same kernel on
both paths. Each query row sees the keys up to its own position through its sequence's block
table; the step's new keys and values must already be in the cache (the attention backend writes
them first, as the fused step's phase 1 does).

The rows it takes: fewer than ``MIN_QUERY_LEN`` queries a sequence (decode rows, speculative
verification rows), on the CPU, with ``MINSERVE_PREFILL_ATTENTION=c`` (the default; ``sdpa``
sends these rows to SDPA too, the reference the tests compare with). Queries and outputs are
float32 inside; a bfloat16 model's rows are widened on the way in and rounded on the way out.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from minserve.kernels.build import KernelUnavailable, load
from minserve.kernels.prefill_attention import MIN_QUERY_LEN, choice

_I64, _P = ctypes.c_int64, ctypes.c_void_p
# decode.c's KV_* codes, by the cache's dtype
KV_FORMATS = {torch.float32: 0, torch.int8: 1, torch.bfloat16: 2}


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = load("decode")
    except KernelUnavailable:
        return None   # no compiler or a failed build: SDPA, as before
    lib.ms_paged_attention.restype = _I64
    lib.ms_paged_attention.argtypes = [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _I64, _P, _I64,
                                       _P, ctypes.c_float, _P, _I64]
    lib.ms_write_kv_int8.restype = None
    lib.ms_write_kv_int8.argtypes = [_P, _I64, _I64, _I64, _P, _P, _P]
    return lib


def applies(q: torch.Tensor, query_len: int, k_cache: torch.Tensor) -> bool:
    """Whether rows ``q`` [rows, H, D] of a group of ``query_len`` queries a sequence go here."""
    return (q.device.type == "cpu" and query_len < MIN_QUERY_LEN and k_cache.dtype in KV_FORMATS
            and q.dtype in (torch.float32, torch.bfloat16) and choice() == "c" and _library() is not None)


def paged_attention(q: torch.Tensor, caches: tuple, tables: torch.Tensor, positions: torch.Tensor,
                    scale: float) -> torch.Tensor | None:
    """Attention of query rows ``q`` [rows, H, D] over the paged ``caches`` = (k_cache, v_cache,
    k_scales, v_scales) ([blocks, block_size, Hkv, D]; scales [blocks, block_size, Hkv] for int8,
    else None): row r sees keys 0 .. positions[r] through block table ``tables[r]``. Returns
    [rows, H * D] in q's dtype, or None when the kernel declines (the caller then runs SDPA)."""
    k_cache, v_cache, k_scales, v_scales = caches
    rows, H, D = q.shape
    if rows == 0:   # a group with no query rows (a draft model's empty chunk)
        return q.new_empty(0, H * D)
    blocks, block_size, Hkv = k_cache.shape[:3]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype
            and (k_scales is None) == (k_cache.dtype != torch.int8) and k_cache.shape[3] == D
            and all(s is None or (s.is_contiguous() and s.dtype == torch.float32
                                  and s.shape == k_cache.shape[:3]) for s in (k_scales, v_scales))):
        return None
    qf = q.float().contiguous()
    t, p = tables.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
    (t_lo, t_hi), (p_lo, p_hi) = (tuple(int(x) for x in a.aminmax()) for a in (t, p))   # the C side reads where they point
    if (t.shape[0] != rows or p.shape != (rows,) or p_lo < 0 or p_hi >= t.shape[1] * block_size
            or t_lo < 0 or t_hi >= blocks):
        raise ValueError(f"paged_attention: {rows} query rows, tables {tuple(t.shape)} (ids {t_lo}..{t_hi} "
                         f"of {blocks} blocks), positions {tuple(p.shape)} ({p_lo}..{p_hi}): want one "
                         f"table row of block ids and one position < its columns x {block_size} per query row")
    out = torch.empty(rows, H, D, dtype=torch.float32)
    scales = [None if s is None else _P(s.data_ptr()) for s in (k_scales, v_scales)]
    rc = _library().ms_paged_attention(
        _P(qf.data_ptr()), rows, H, Hkv, D, _P(k_cache.data_ptr()), _P(v_cache.data_ptr()), *scales,
        KV_FORMATS[k_cache.dtype], block_size, _P(t.data_ptr()), t.shape[1], _P(p.data_ptr()), scale,
        _P(out.data_ptr()), torch.get_num_threads())
    if rc != 0:
        return None   # -1: shapes it does not take; -2: out of memory
    return out.view(rows, H * D).to(q.dtype)


def write_kv_int8(cache: torch.Tensor, scales: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor) -> bool:
    """New tokens' keys or values ``x`` [T, Hkv, D] quantized into their ``slot_mapping`` [T] slots of
    an int8 ``cache`` [blocks, block_size, Hkv, D] and its ``scales`` [blocks, block_size, Hkv], in C
    and bit for bit as kernels/triton/reference.py's write_kv_int8 (the fused step's own writer).
    False when the kernel declines (another device or layout, no compiler): the caller writes in
    PyTorch. ValueError for a slot outside the cache."""
    if not (cache.device.type == "cpu" and x.device.type == "cpu" and cache.dtype == torch.int8
            and cache.dim() == 4 and cache.is_contiguous() and scales.dtype == torch.float32
            and scales.is_contiguous() and scales.shape == cache.shape[:3] and x.dim() == 3
            and x.shape[1:] == cache.shape[2:] and slot_mapping.shape == (x.shape[0],)
            and _library() is not None):
        return False
    if x.shape[0] == 0:
        return True
    slots = slot_mapping.to(torch.int64).contiguous()
    lo, hi = (int(v) for v in slots.aminmax())
    if lo < 0 or hi >= cache.shape[0] * cache.shape[1]:
        raise ValueError(f"write_kv_int8: slots {lo}..{hi} outside the cache's "
                         f"{cache.shape[0] * cache.shape[1]} slots")
    xf = x.float().contiguous()
    _library().ms_write_kv_int8(_P(xf.data_ptr()), x.shape[0], x.shape[1], x.shape[2], _P(slots.data_ptr()),
                                _P(cache.data_ptr()), _P(scales.data_ptr()))
    return True
