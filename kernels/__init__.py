"""Kernels: hand-written compute for the hot paths PyTorch's generic operators serve poorly.

- ``decode``: the fused CPU decode step (C, compiled on first use by ``build``), used by the model
  runner for steps where every sequence adds one token.
"""
