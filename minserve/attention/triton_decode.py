"""Decode steps on CUDA through the Triton paged-attention kernel (kernels/triton/paged_decode.py).

A decode step has one new token per sequence, so its attention is one query row per sequence
against that sequence's cached keys: exactly what ``paged_decode`` computes, reading the paged
cache through the block tables (float K/V, or int8 codes dequantized in registers) with no gathered
copy of the blocks, which is what the PyTorch reference (attention/torch_paged.py) makes per layer.

How it plugs in (attention/backend.py): the layers keep running in PyTorch, and this backend's
per-layer op replaces the torch op (``LlamaForCausalLM.use_attention``). The op serves both kinds
of step: given this backend's metadata (decode steps: the runner picks this backend first when
every query length is 1) it writes the new K/V into their slots and calls the kernel; given the
torch backend's metadata (prefill chunks, speculative verification, prompt logprobs) it hands the
call to the torch op. Used on CUDA when Triton is installed and the head size is one the kernel
compiles for (a power of two, 16..256); tested on the CPU under Triton's interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minserve.attention.backend import AttentionBackend, StepSequences
from minserve.attention.torch_paged import TorchPagedAttention, write_new_kv


@dataclass
class TritonDecodeMetadata:
    slot_mapping: torch.Tensor   # [B] cache slot of each sequence's new token
    block_tables: torch.Tensor   # [B, max blocks] int32, padded with block 0 (never read past a length)
    context_lens: torch.Tensor   # [B] int32: keys each row attends, its new token included


def head_dim_supported(head_dim: int) -> bool:
    """The head sizes paged_decode compiles for."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


class TritonDecodeAttention:
    """The per-layer op: the Triton kernel for decode metadata, the torch op for anything else."""

    name = "triton-decode"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.fallback = TorchPagedAttention(num_heads, num_kv_heads, head_dim)

    def __call__(self, q, k, v, k_cache, v_cache, meta, k_scales=None, v_scales=None) -> torch.Tensor:
        if not isinstance(meta, TritonDecodeMetadata):
            return self.fallback(q, k, v, k_cache, v_cache, meta, k_scales, v_scales)
        from minserve.kernels.triton.paged_decode import paged_decode
        write_new_kv(k, v, (k_cache, v_cache, k_scales, v_scales), meta.slot_mapping)
        out = paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, k_scales, v_scales)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)


class TritonDecodeBackend(AttentionBackend):
    name = "triton-decode"

    def __init__(self, block_size: int, device: torch.device | str):
        self.block_size, self.device = block_size, device

    def unsupported_reason(self, seqs: StepSequences) -> str | None:
        if not seqs.query_lens or any(q != 1 for q in seqs.query_lens):
            return "the Triton decode backend runs steps of one new token per sequence"
        return None

    def build_metadata(self, seqs: StepSequences) -> TritonDecodeMetadata:
        bs, width = self.block_size, max(1, max(len(t) for t in seqs.block_tables))
        slots = [t[c // bs] * bs + c % bs for t, c in zip(seqs.block_tables, seqs.context_lens)]
        tables = [list(t) + [0] * (width - len(t)) for t in seqs.block_tables]
        on = dict(device=self.device)
        return TritonDecodeMetadata(
            torch.tensor(slots, dtype=torch.long, **on), torch.tensor(tables, dtype=torch.int32, **on),
            torch.tensor([c + 1 for c in seqs.context_lens], dtype=torch.int32, **on))

    def layer_attention(self, num_heads: int, num_kv_heads: int, head_dim: int) -> TritonDecodeAttention:
        return TritonDecodeAttention(num_heads, num_kv_heads, head_dim)
