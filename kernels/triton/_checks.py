"""Input checks shared by the launchers: every error names the argument and what was expected.

Checks read only shapes, dtypes and devices (no ``.item()``, so no GPU synchronisation); value
checks (block ids in range, context lengths within the table) run only on CPU tensors, where they
are free, i.e. under the Triton interpreter in the tests.
"""

from __future__ import annotations

import contextlib
import os

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def check_tensor(name: str, t, *, dtypes=None, ndim: int | None = None, shape=None) -> torch.Tensor:
    """``shape`` entries may be None (any size)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}; got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D; got shape {tuple(t.shape)}")
    if shape is not None:
        want = tuple("*" if s is None else s for s in shape)
        if len(shape) != t.dim() or any(s is not None and s != a for s, a in zip(shape, t.shape)):
            raise ValueError(f"{name} must have shape {want}; got {tuple(t.shape)}")
    return t


def check_inner_contiguous(name: str, t: torch.Tensor) -> None:
    """The kernels read rows as contiguous runs (one coalesced load per row)."""
    if t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must be contiguous in its last dimension; got strides {t.stride()}")


def check_devices(kernel, **tensors: torch.Tensor | None) -> torch.device:
    """All tensors on one device; CPU only when the kernel was built by the Triton interpreter."""
    named = {n: t for n, t in tensors.items() if t is not None}
    first_name, first = next(iter(named.items()))
    for n, t in named.items():
        if t.device != first.device:
            raise ValueError(f"{n} is on {t.device} but {first_name} is on {first.device}; "
                             "all inputs must be on one device")
    if first.device.type == "cpu" and _captured is None and type(kernel).__name__ != "InterpretedFunction":
        hint = ("TRITON_INTERPRET=1 was set after this module was imported" if interpreting()
                else "set TRITON_INTERPRET=1 before importing it to run on the CPU interpreter")
        raise RuntimeError(f"{first_name} is on the CPU, but this Triton kernel was compiled for a GPU: {hint}")
    return first.device


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors to fill (used to split long work); 1 off the GPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


# Test seam: inside capture_launches() the launchers record (kernel, grid, args, kwargs) instead of
# running, so compile_check.py can compile exactly what they would launch for a GPU it does not have.
_captured: list | None = None


@contextlib.contextmanager
def capture_launches():
    global _captured
    previous, _captured = _captured, []
    try:
        yield _captured
    finally:
        _captured = previous


def launch(kernel, grid, *args, **kwargs) -> None:
    if _captured is not None:
        _captured.append((kernel, grid, args, kwargs))
    else:
        kernel[grid](*args, **kwargs)
