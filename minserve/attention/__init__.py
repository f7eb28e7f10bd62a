"""Paged attention: per-step metadata and backends (torch reference, Triton on CUDA). The fused C
step, which computes the whole model, is a step executor (engine/fused_step.py), not a backend."""

from minserve.attention.backend import AttentionBackend, StepSequences, TorchAttentionBackend
from minserve.attention.metadata import AttentionGroup, AttentionMetadata, build_attention_metadata
from minserve.attention.torch_paged import TorchPagedAttention

__all__ = ["AttentionBackend", "StepSequences", "TorchAttentionBackend", "AttentionGroup", "AttentionMetadata", "build_attention_metadata", "TorchPagedAttention"]
