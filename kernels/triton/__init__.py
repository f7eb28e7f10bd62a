"""Triton kernels for the GPU path, each beside its torch reference.

- ``w8a16``: ``x @ W.T`` with int8 weights and per-channel scales, dequantized in registers.
- ``w4a16``: the same with 4-bit weights, two per byte, scale and min per group (GGUF Q4_1's form).
- ``paged_decode``: decode attention over minserve's paged KV cache (float or int8 K/V), grouped-query,
  split-K for small batches.
- ``reference``: the layouts (quantizers, packing, int8 KV quantize-on-write) and float32 torch
  references for all three. It imports only torch: the engine can use it without Triton.
- ``compile_check``: compiles every kernel for sm_90 on a machine without a GPU.

On a CPU the kernels run under Triton's interpreter: set ``TRITON_INTERPRET=1`` before importing
the kernel modules (tests/test_triton_kernels.py does). ``kernels/bench_gpu.py`` checks and times
them on a GPU against the memory-bandwidth roofline.

Nothing here imports Triton until a kernel is asked for, so ``import minserve.kernels.triton`` (and
``.reference``) works where Triton is not installed; :func:`available` says whether it is.
"""

from __future__ import annotations

import importlib

_LAUNCHERS = {"w8a16_matmul": "w8a16", "w4a16_matmul": "w4a16", "paged_decode": "paged_decode"}

__all__ = ["available", *_LAUNCHERS]


def available() -> bool:
    """True when the ``triton`` package can be imported (a GPU is a separate question)."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def __getattr__(name: str):
    if name in _LAUNCHERS:
        return getattr(importlib.import_module(f"{__name__}.{_LAUNCHERS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
