"""Paged-attention decode: one query token per sequence against its K/V scattered over cache blocks.

Layout (minserve/attention/torch_paged.py): per-layer caches [num_blocks, block_size, Hkv, D];
token p of sequence b lives at slot ``p % block_size`` of block ``block_tables[b, p // block_size]``.

Why it looks like this:

* Decode attention reads every cached key and value once and does ~2 FLOPs per byte: it is bound by
  memory bandwidth, so the design goal is to read the cache once, at full speed.
* One program handles one sequence and one *kv head*, with all ``H / Hkv`` query heads that share it
  (grouped-query attention): each K/V tile is loaded once for the whole group, not once per head.
  The group is padded to 16 rows so the two products run on the tensor cores (``tl.dot``).
* Tokens are gathered BLOCK_N at a time through the block table, whatever the cache block size, so
  the kernel does not care whether blocks are 1 or 256 tokens, nor whether they are consecutive.
* Online softmax (running max and sum, rescaled per tile) keeps one pass over the keys.
* Split-K ("flash-decoding"): with few sequences, B * Hkv programs cannot occupy a GPU's SMs, so the
  context is cut into ``num_splits`` partitions processed in parallel; each writes its normalised
  partial output and log-sum-exp, and a second small kernel merges them.
* Int8 KV: codes are read instead of fp16 (half the bytes) and never dequantized as a tile: the key
  scale multiplies the score (``q . (c * s) = s * (q . c)``) and the value scale multiplies the
  probability (``sum p * s * c = sum (p * s) * c``).

The torch reference (:func:`paged_decode_reference`) is in reference.py beside this file.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._checks import (FLOATS, check_devices, check_inner_contiguous, check_tensor, launch, next_pow2,
                      sm_count)
from .reference import paged_decode_reference, quantize_kv_int8, write_kv_int8

__all__ = ["paged_decode", "paged_decode_reference", "quantize_kv_int8", "write_kv_int8"]

_LOG2E = 1.4426950408889634


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, lens_ptr, out_ptr,
                         part_ptr, lse_ptr, block_size, partition, num_splits, qk_scale_log2,
                         stride_qb, stride_qh, stride_kb, stride_ks, stride_kh,
                         stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
                         stride_tb, stride_ob, stride_oh,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, KV_INT8: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    start = split * partition
    end = tl.minimum(start + partition, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    g_ok = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None], other=0.0)  # [GROUP_PAD, D]
    cdt = q.dtype  # the tensor cores multiply in the query's dtype; int8 codes widen to it exactly

    m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
    table_row = table_ptr + b.to(tl.int64) * stride_tb
    for t0 in range(start, end, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        t_ok = offs_t < end
        block = tl.load(table_row + offs_t // block_size, mask=t_ok, other=0).to(tl.int64)
        slot = (offs_t % block_size).to(tl.int64)
        k_rows = block * stride_kb + slot * stride_ks + kvh * stride_kh
        k = tl.load(k_ptr + k_rows[:, None] + offs_d[None, :], mask=t_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(cdt)), input_precision=DOT_PRECISION)  # [GROUP_PAD, BLOCK_N]
        if KV_INT8:
            s_rows = block * stride_sb + slot * stride_ss + kvh * stride_sh
            s = s * tl.load(ks_ptr + s_rows, mask=t_ok, other=0.0)[None, :]
        s = tl.where(t_ok[None, :], s * qk_scale_log2, float("-inf"))  # log2 domain: exp2 is cheaper
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_rows = block * stride_vb + slot * stride_vs + kvh * stride_vh
        v = tl.load(v_ptr + v_rows[:, None] + offs_d[None, :], mask=t_ok[:, None], other=0.0)
        if KV_INT8:
            p = p * tl.load(vs_ptr + s_rows, mask=t_ok, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(cdt), v.to(cdt), input_precision=DOT_PRECISION)
        m_i = m_new

    has = l_i > 0  # false for an empty partition (or a sequence with no keys): write zeros
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if not SPLIT:
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:  # partials: [B, H, num_splits, D] float32 and log2-sum-exp [B, H, num_splits]
        row = (b * (GROUP * tl.num_programs(1)) + heads) * num_splits + split
        tl.store(part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=g_ok[:, None])
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=g_ok)


@triton.jit
def _merge_splits_kernel(part_ptr, lse_ptr, out_ptr, num_heads, num_splits, stride_ob, stride_oh,
                         HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr):
    # Each partial is softmax-normalised over its own keys; weighting it by exp(lse_i - max) / sum
    # gives the softmax over all keys.
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, HEAD_DIM)
    row = (b * num_heads + h) * num_splits + offs_s
    lse = tl.load(lse_ptr + row, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - top))
    part = tl.load(part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(part * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


def _choose_splits(device: torch.device, batch: int, num_kv_heads: int, max_tokens: int,
                   block_n: int) -> int:
    """Enough partitions that B * Hkv * splits programs fill the GPU about twice, none shorter than
    one BLOCK_N tile. Sized from the block table's width, not the lengths, so no GPU sync."""
    want = math.ceil(2 * sm_count(device) / (batch * num_kv_heads))
    return max(1, min(want, math.ceil(max_tokens / block_n), 64))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, *,
                 num_splits: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """Attention of ``q`` [B, H, D] over each sequence's first ``context_lens[b]`` cached tokens
    -> [B, H, D] in ``q.dtype``; scale D ** -0.5, grouped-query (H a multiple of Hkv).

    Caches are [num_blocks, block_size, Hkv, D]: float (any of fp16/bf16/fp32), or int8 codes with
    ``k_scale``/``v_scale`` float32 [num_blocks, block_size, Hkv] (see reference.quantize_kv_int8).
    ``block_tables`` [B, max_blocks] int32/int64; ``context_lens`` [B] int32/int64.
    ``num_splits`` (split-K partitions) defaults to what fills the GPU; ``block_n`` (tokens per tile,
    a power of two >= 16) to 64."""
    check_tensor("q", q, dtypes=FLOATS, ndim=3)
    batch, num_heads, head_dim = q.shape
    int8 = k_scale is not None or v_scale is not None
    cache_dtypes = (torch.int8,) if int8 else FLOATS
    check_tensor("k_cache", k_cache, dtypes=cache_dtypes, ndim=4)
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    check_tensor("k_cache", k_cache, shape=(None, None, None, head_dim))
    check_tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), shape=tuple(k_cache.shape))
    if int8:
        check_tensor("k_scale", k_scale, dtypes=(torch.float32,), shape=tuple(k_cache.shape[:3]))
        check_tensor("v_scale", v_scale, dtypes=(torch.float32,), shape=tuple(k_cache.shape[:3]))
    if num_heads % num_kv_heads:
        raise ValueError(f"q has {num_heads} heads, not a multiple of k_cache's {num_kv_heads} kv heads")
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"q: head_dim must be a power of two in 16..256; got {head_dim}")
    check_tensor("block_tables", block_tables, dtypes=(torch.int32, torch.int64), ndim=2)
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must have {batch} rows (one per sequence in q); "
                         f"got shape {tuple(block_tables.shape)}")
    check_tensor("context_lens", context_lens, dtypes=(torch.int32, torch.int64), shape=(batch,))
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables)):
        check_inner_contiguous(name, t)
    kernel = _paged_decode_kernel
    device = check_devices(kernel, q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                           context_lens=context_lens, k_scale=k_scale, v_scale=v_scale)
    max_tokens = block_tables.shape[1] * block_size
    if device.type == "cpu" and batch:  # value checks are free here; on a GPU they would sync
        if context_lens.min() < 0 or context_lens.max() > max_tokens:
            raise ValueError(f"context_lens must lie in 0..{max_tokens} (block_tables width x block_size); "
                             f"got {context_lens.tolist()}")
        if block_tables.numel() and (block_tables.min() < 0 or block_tables.max() >= num_blocks):
            raise ValueError(f"block_tables entries must lie in 0..{num_blocks - 1} (k_cache blocks)")
    block_n = 64 if block_n is None else block_n
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16; got {block_n}")
    if num_splits is None:
        num_splits = _choose_splits(device, batch, num_kv_heads, max_tokens, block_n)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1; got {num_splits}")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    # Partition length: a whole number of BLOCK_N tiles, so only the sequence's last tile is partial.
    partition = triton.cdiv(triton.cdiv(max(max_tokens, 1), num_splits), block_n) * block_n
    if num_splits > 1:
        part = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=device)
        lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=device)
    else:
        part = lse = out  # unused
    if int8:  # one set of strides serves both scale tensors
        k_scale, v_scale = k_scale.contiguous(), v_scale.contiguous()
    ks = k_scale if int8 else q
    vs = v_scale if int8 else q
    sk = ks.stride() if int8 else (0, 0, 0)
    launch(
        kernel, (batch, num_kv_heads, num_splits),
        q, k_cache, v_cache, ks, vs, block_tables, context_lens, out, part, lse,
        block_size, partition, num_splits, head_dim ** -0.5 * _LOG2E,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], *sk,
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=head_dim, BLOCK_N=block_n,
        SPLIT=num_splits > 1, KV_INT8=int8,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, num_stages=2)
    if num_splits > 1:
        launch(_merge_splits_kernel, (batch, num_heads),
               part, lse, out, num_heads, num_splits, out.stride(0), out.stride(1), HEAD_DIM=head_dim,
               SPLITS_PAD=next_pow2(num_splits), num_warps=4)
    return out
