"""Paged attention in plain PyTorch: the reference backend, and the one used on CPU.

Keys and values live in per-layer caches shaped ``[num_blocks, block_size, kv_heads, head_dim]``.
A step writes the new tokens' K/V into their slots, then each group gathers its sequences' blocks
through their block tables and runs one ``scaled_dot_product_attention`` call (grouped-query
attention handled by SDPA itself, no repeated K/V copies).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minserve.attention.metadata import AttentionMetadata


class TorchPagedAttention:
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> attention output [T, H * D]."""
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)
        if len(meta.groups) == 1:
            return self._group(q, k_cache, v_cache, meta.groups[0])
        return torch.cat([self._group(q[g.token_start:g.token_end], k_cache, v_cache, g)
                          for g in meta.groups], dim=0)

    def _group(self, q, k_cache, v_cache, g) -> torch.Tensor:
        n, ql = g.num_seqs, g.query_len
        # [n, blocks, block_size, Hkv, D] -> [n, L, Hkv, D] -> [n, Hkv, L, D]
        keys, values = self._gather(k_cache, g), self._gather(v_cache, g)
        queries = q.view(n, ql, self.num_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.mask,
                                             is_causal=g.is_causal, scale=self.scale,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return out.transpose(1, 2).reshape(n * ql, self.num_heads * self.head_dim)

    @staticmethod
    def _gather(cache: torch.Tensor, g) -> torch.Tensor:
        if g.first_block is not None:
            # Consecutive blocks (common for a lone request in a fresh pool): a view, no copy.
            blocks = cache[g.first_block:g.first_block + g.kv_blocks.shape[1]].unsqueeze(0)
        else:
            blocks = cache[g.kv_blocks]
        return blocks.flatten(1, 2)[:, :g.kv_len].transpose(1, 2)
