"""Paged attention: per-step metadata and backends (torch reference, fused C on CPU, Triton on CUDA)."""

from minserve.attention.backend import AttentionBackend, StepSequences, TorchAttentionBackend
from minserve.attention.metadata import AttentionGroup, AttentionMetadata, build_attention_metadata
from minserve.attention.torch_paged import TorchPagedAttention

__all__ = ["AttentionBackend", "StepSequences", "TorchAttentionBackend", "AttentionGroup", "AttentionMetadata", "build_attention_metadata", "TorchPagedAttention"]
