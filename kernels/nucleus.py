"""The top-p filter of the sampler's rows in C (kernels/nucleus.c): bins and one small sort, not a
sort of the row.

:func:`top_p_` filters the given rows of a float32 logits matrix in place and returns True, or
returns False without touching them when the kernel does not apply (not a float32 CPU matrix with
unit column stride, no compiler, ``MINSERVE_SAMPLER_FILTERS=torch``); the sampler then runs its
torch path (minserve/engine/sampler.py), which keeps the same tokens up to rounding at the
boundary and the order of tied tokens (nucleus.c says how it breaks ties).
``MINSERVE_SAMPLER_FILTERS=c`` (the default) uses the kernel wherever it applies.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from minserve.kernels.build import KernelUnavailable, env_choice, load

CHOICES = ("c", "torch")
_P, _I = ctypes.c_void_p, ctypes.c_int64


def choice() -> str:
    """``MINSERVE_SAMPLER_FILTERS``: "c" (default) or "torch"; anything else is an error."""
    return env_choice("MINSERVE_SAMPLER_FILTERS", CHOICES)


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = load("nucleus")
    except KernelUnavailable:
        return None   # no compiler or a failed build: the torch path, as before the kernel
    lib.ms_top_p.restype = _I
    lib.ms_top_p.argtypes = [_P, _I, _I, _P, _I, _P, _I]
    return lib


def applies(logits: torch.Tensor) -> bool:
    """Whether :func:`top_p_` would take ``logits`` [R, V]."""
    return (logits.device.type == "cpu" and logits.dtype is torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and choice() == "c" and _library() is not None)


def top_p_(logits: torch.Tensor, rows: list[int], top_p: list[float], num_threads: int = 0) -> bool:
    """In place, for each ``rows[i]`` of ``logits`` [R, V]: every token outside its ``top_p[i]``
    nucleus (>= 1: none) set to -inf. False (nothing done) when the kernel does not apply."""
    if not applies(logits):
        return False
    if len(rows) != len(top_p):
        raise ValueError(f"top_p_: {len(rows)} rows but {len(top_p)} top_p values")
    if not rows:
        return True
    if min(rows) < 0 or max(rows) >= logits.shape[0]:
        raise ValueError(f"top_p_: rows must be in [0, {logits.shape[0]}), got {rows}")
    if len(set(rows)) != len(rows):   # two threads would filter one row at once
        raise ValueError(f"top_p_: rows must be distinct, got {rows}")
    row_ids = torch.tensor(rows, dtype=torch.int64)
    ps = torch.tensor(top_p, dtype=torch.float32)
    rc = _library().ms_top_p(logits.data_ptr(), logits.stride(0), logits.shape[1], row_ids.data_ptr(),
                             len(rows), ps.data_ptr(), max(0, int(num_threads)))
    if rc:   # some rows may be filtered already, and top-p twice is not top-p once: no fallback
        raise MemoryError(f"top_p_: no scratch for rows of {logits.shape[1]} tokens")
    return True
