"""Paged attention in plain PyTorch: the reference backend, and the one used on CPU.

Keys and values live in per-layer caches shaped ``[num_blocks, block_size, kv_heads, head_dim]``.
A step writes the new tokens' K/V into their slots, then each group gathers its sequences' blocks
through their block tables and runs one ``scaled_dot_product_attention`` call (grouped-query
attention handled by SDPA itself, no repeated K/V copies).

With ``kv_cache_dtype="int8"`` the caches hold int8 codes and the op also receives their scales
``[num_blocks, block_size, kv_heads]`` (engine/kv_cache.py): new K/V are quantized on write, and
the gathered blocks are dequantized before SDPA. That is the simple, correct path, not a fast one:
each layer materialises a float copy of every gathered K and V (4 bytes per element written,
after 1 read), so it saves pool memory (more tokens fit) but not attention bandwidth, and it never
reads a lone sequence's blocks as a view. Kernels that dequantize as they read (the C ones below,
kernels/triton/paged_decode.py, the fused C step) are where int8 KV can become speed.

Prefill chunks in float32 on the CPU (at least ``MIN_QUERY_LEN`` queries) run their attention in C
instead (kernels/prefill_attention.py: a flash attention about twice as fast as PyTorch's CPU SDPA,
reading float32 or int8 blocks of the cache in place), and so do the rows of shorter groups, decode
rows above all (kernels/paged_attention.py: the fused decode step's attention, reading the cache in
place, int8 codes included); anything they do not take goes to SDPA as before. In the
batch-invariant mode every group takes the flash kernel, whatever its length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minserve.attention.metadata import AttentionMetadata
from minserve.kernels import paged_attention as paged
from minserve.kernels.prefill_attention import MIN_QUERY_LEN, applies, prefill_attention, prefill_attention_paged
from minserve.kernels.triton.reference import dequantize_kv_int8, write_kv_int8


def write_new_kv(k: torch.Tensor, v: torch.Tensor, caches: tuple, slot_mapping: torch.Tensor) -> None:
    """The step's new keys and values [T, Hkv, D] into their slots of ``caches`` = (k_cache,
    v_cache, k_scales, v_scales): copied into a float cache, quantized on write into an int8 one."""
    k_cache, v_cache, k_scales, v_scales = caches
    if k_scales is None:
        k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)
    else:   # in C where it can (the same bits), else in PyTorch
        for cache, scales, x in ((k_cache, k_scales, k), (v_cache, v_scales, v)):
            if not paged.write_kv_int8(cache, scales, slot_mapping, x):
                write_kv_int8(cache, scales, slot_mapping, x)


class TorchPagedAttention:
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, batch_invariant: bool = False):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        # Every group through one kernel whose rows do not depend on the call (EngineConfig's
        # batch_invariant): the choices below by query length would give a token other bits when
        # its chunk is cut elsewhere, and the cut depends on the other requests of the step.
        self.batch_invariant = batch_invariant

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> attention output [T, H * D]. ``k_scales``/``v_scales``:
        given for an int8 cache (one float32 per slot and kv head), None for a float one."""
        write_new_kv(k, v, (k_cache, v_cache, k_scales, v_scales), meta.slot_mapping)
        caches = (k_cache, v_cache, k_scales, v_scales)
        if len(meta.groups) == 1:
            return self._group(q, caches, meta.groups[0])
        return torch.cat([self._group(q[g.token_start:g.token_end], caches, g) for g in meta.groups], dim=0)

    def _group(self, q, caches, g) -> torch.Tensor:
        if self.batch_invariant:
            out = prefill_attention_paged(q.view(-1, self.num_heads, self.head_dim), caches, g.kv_blocks,
                                          g.context_lens_tensor, self.scale)
            if out is None:   # the engine checked the kernel applies (engine/batch_invariance.py)
                raise RuntimeError("batch_invariant: the C attention kernel declined a step; its rows "
                                   "cannot be computed batch-invariantly")
            return out
        if g.query_len >= MIN_QUERY_LEN and applies(q, self.head_dim):
            # float32: the kernel reads the paged cache in place, the same bits as the gathered
            # copies below without making them; bfloat16: the copies.
            out = prefill_attention_paged(q.view(-1, self.num_heads, self.head_dim), caches, g.kv_blocks,
                                          g.context_lens_tensor, self.scale)
            if out is None:
                out = self._prefill_in_c(q, caches, g)
            if out is not None:
                return out
        if paged.applies(q, g.query_len, caches[0]):   # decode rows: the cache read in place
            out = paged.paged_attention(q.view(-1, self.num_heads, self.head_dim), caches, g.row_tables,
                                        g.row_positions, self.scale)
            if out is not None:
                return out
        n, ql = g.num_seqs, g.query_len
        k_cache, v_cache, k_scales, v_scales = caches
        # [n, blocks, block_size, Hkv, D] -> [n, L, Hkv, D] -> [n, Hkv, L, D]
        keys, values = self._gather(k_cache, g), self._gather(v_cache, g)
        if k_scales is not None:  # int8: codes x their per-(slot, head) scale, in the query's dtype
            keys = dequantize_kv_int8(keys, self._gather(k_scales, g)).to(q.dtype)
            values = dequantize_kv_int8(values, self._gather(v_scales, g)).to(q.dtype)
        queries = q.view(n, ql, self.num_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.mask,
                                             is_causal=g.is_causal, scale=self.scale,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return out.transpose(1, 2).reshape(n * ql, self.num_heads * self.head_dim)

    def _prefill_in_c(self, q, caches, g) -> torch.Tensor | None:
        """Each sequence's chunk through the C kernel: its queries see its cached context and
        its own earlier positions, the same keys g.mask lets SDPA see. None: use SDPA."""
        k_cache, v_cache, k_scales, v_scales = caches
        keys, values = self._rows(k_cache, g), self._rows(v_cache, g)   # [n, L, Hkv, D]
        if k_scales is not None:  # int8: codes x scales, in the query's dtype (as for SDPA below)
            keys = dequantize_kv_int8(keys, self._rows(k_scales, g)).to(q.dtype)
            values = dequantize_kv_int8(values, self._rows(v_scales, g)).to(q.dtype)
        queries = q.view(g.num_seqs, g.query_len, self.num_heads, self.head_dim)
        outs = []
        for i, ctx in enumerate(g.context_lens):
            kv_len = ctx + g.query_len
            out = prefill_attention(queries[i], keys[i, :kv_len], values[i, :kv_len], self.scale)
            if out is None:
                return None
            outs.append(out.view(g.query_len, -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @staticmethod
    def _rows(cache: torch.Tensor, g) -> torch.Tensor:
        """A cache's blocks for the group as token rows [n, L, ...]: K/V [.., Hkv, D] or scales."""
        if g.first_block is not None:
            # Consecutive blocks (common for a lone request in a fresh pool): a view, no copy.
            blocks = cache[g.first_block:g.first_block + g.kv_blocks.shape[1]].unsqueeze(0)
        else:
            # index_select copies whole blocks with memcpy: 4x faster than cache[g.kv_blocks]'s
            # advanced indexing (15 sequences x 27 bf16 blocks: 130 against 500 us, 2026-12-06),
            # which a mixed step pays twice a layer for its decode rows.
            n, per_seq = g.kv_blocks.shape
            blocks = cache.index_select(0, g.kv_blocks.reshape(-1)).view(n, per_seq, *cache.shape[1:])
        return blocks.flatten(1, 2)[:, :g.kv_len]

    @classmethod
    def _gather(cls, cache: torch.Tensor, g) -> torch.Tensor:
        """A cache's blocks for the group as [n, Hkv, L, ...]: K/V [.., D] or scales (no last dim)."""
        return cls._rows(cache, g).transpose(1, 2)
