"""How a step's attention is computed: one interface, several backends.

The runner describes a step as :class:`StepSequences` (per sequence: new tokens, cached tokens,
block table). Each backend builds its *own* metadata from that, so none has to read another's:
- ``torch``: the PyTorch reference (attention/torch_paged.py), any step, any device;
- ``triton-decode``: decode steps on CUDA through the Triton paged-decode kernel
  (attention/triton_decode.py, kernels/triton/paged_decode.py); other steps go to the torch op.

A backend provides the per-layer attention that the PyTorch model calls. Which forward pass runs a
step, the PyTorch model attending through a backend or the fused C step that computes the whole
model (engine/fused_step.py), is the runner's choice of *step executor* (engine/step_executor.py):
it asks them in order of preference and uses the first whose ``unsupported_reason`` is None; the
model with ``torch`` attention supports every step, so it is last.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from minserve.attention.metadata import AttentionMetadata, build_attention_metadata
from minserve.attention.torch_paged import TorchPagedAttention


@dataclass
class StepSequences:
    """A step as attention sees it, sequence by sequence, in the order of the flat batch."""
    query_lens: list[int]            # new tokens (1 decode, k + 1 verify, n prefill chunk)
    context_lens: list[int]          # tokens already in the KV cache
    block_tables: list[list[int]]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


class AttentionBackend(ABC):
    name: str

    def unsupported_reason(self, seqs: StepSequences) -> str | None:
        """Why this backend cannot run the step (None: it can)."""
        return None

    @abstractmethod
    def build_metadata(self, seqs: StepSequences):
        """What the backend needs per step, built once and shared by every layer."""

    def layer_attention(self, num_heads: int, num_kv_heads: int, head_dim: int):
        """For backends that run inside the model: the per-layer op, called as
        ``op(q, k, v, k_cache, v_cache, metadata)``, with ``k_scales, v_scales`` after it for an
        int8 KV cache (engine/kv_cache.py); LlamaForCausalLM.use_attention installs it."""
        raise NotImplementedError(f"the {self.name} backend has no per-layer op")


class TorchAttentionBackend(AttentionBackend):
    """The reference: gathers blocks and calls SDPA per group of equal query lengths."""
    name = "torch"

    def __init__(self, block_size: int, device: torch.device | str, batch_invariant: bool = False):
        self.block_size, self.device, self.batch_invariant = block_size, device, batch_invariant

    def layer_attention(self, num_heads: int, num_kv_heads: int, head_dim: int) -> TorchPagedAttention:
        return TorchPagedAttention(num_heads, num_kv_heads, head_dim, self.batch_invariant)

    def build_metadata(self, seqs: StepSequences) -> AttentionMetadata:
        return build_attention_metadata(seqs.query_lens, seqs.context_lens, seqs.block_tables,
                                        self.block_size, self.device)
