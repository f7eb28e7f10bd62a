"""Weight-only quantization formats: the tensor layouts every kernel reads, and torch references.

These functions are the *contract*: the C kernels (kernels/quant.c) read exactly these layouts,
and so must the Triton kernels and the fused decode step; each kernel is tested against
``dequantize_*`` here followed by ``F.linear``. They are written to be read, not to be fast: a
model is quantized once.

int8 (W8A16: int8 weights, activations stay float)
    Per-output-channel symmetric. ``codes`` int8 ``[out, in]``, ``scales`` float32 ``[out]``,
    ``w ~ codes * scales[:, None]``, ``scale = max|w_row| / 127``, codes in -127..127 (-128 unused,
    so the range is symmetric). One scale per row is enough at 8 bits: 255 levels cover a row's
    spread, and a per-row scale factors out of the dot product (``y_r = scale_r * (codes_r . x)``).

int4 (group-wise asymmetric, GGUF Q4_1's form)
    Groups of ``group_size`` (32, 64 or 128) consecutive input features share a scale and a min:
    ``w ~ q * scale + min`` with ``q`` in 0..15, ``min`` = the group minimum and
    ``scale = (max - min) / 15``. ``packed`` uint8 ``[out, in / 2]`` holds two codes a byte:
    column ``2i`` in the LOW nibble, column ``2i + 1`` in the HIGH nibble. ``scales`` and ``mins``
    are float32 ``[out, in / group_size]``.
    Why min/scale rather than a zero point: it is llama.cpp's Q4_1 block (``d``, ``m``, 32 codes),
    so weights that came from a Q4_1 GGUF (SmolLM2-135M's, dequantized into our fp32 cache) are
    quantized back to the very same codes with g=32 and reproduce bit for bit: no second
    quantization error on top of the one the model file already has (:func:`reproduction`
    measures it). Q4_1 stores d and m as fp16 and rounds with ``(int)(x + 0.5)``; we keep
    float32 and ``torch.round``, which agree on such weights because every code is then an exact
    integer before rounding.

Both rounding steps are round-to-nearest (``torch.round``: ties to even) with a clamp to the code
range. An all-zero row (int8) or a group whose weights are all equal (int4) gets scale 1, so
nothing divides by zero and the codes reproduce it exactly (codes 0; for int4 q = 0, w = min).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP_SIZES = (32, 64, 128)


def _check_weight(w: torch.Tensor, fmt: str) -> None:
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"{fmt} quantization takes a 2-D weight [out_features, in_features], got {shape}")
    if not w.is_floating_point():
        raise ValueError(f"{fmt} quantization takes floating-point weights, got {w.dtype}")
    if not torch.isfinite(w).all():
        raise ValueError(f"{fmt} quantization needs finite weights: this one holds inf or nan")


def check_group_size(group_size: int, in_features: int, out_features: int | None = None) -> None:
    """Raise ValueError unless ``group_size`` is allowed and divides ``in_features``."""
    layer = f"[{out_features} x {in_features}]" if out_features is not None else f"in_features {in_features}"
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r} "
                         f"(layer {layer})")
    if in_features % group_size:
        fits = [g for g in INT4_GROUP_SIZES if in_features % g == 0]
        raise ValueError(f"int4 group_size {group_size} does not divide in_features {in_features} of "
                         f"the layer {layer}; group sizes that fit: {fits or 'none'}")


# ---------------------------------------------------------------------------------------------- int8

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` -> ``(codes int8 [out, in], scales float32 [out])``, per-row symmetric."""
    _check_weight(w, "int8")
    w = w.detach().float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    codes = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.contiguous(), scales.contiguous()


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``codes * scales[:, None]`` as float32 ``[out, in]``."""
    if codes.dtype != torch.int8 or codes.dim() != 2:
        raise ValueError(f"int8 codes must be a 2-D int8 tensor, got {codes.dtype} {tuple(codes.shape)}")
    if scales.shape != (codes.shape[0],):
        raise ValueError(f"int8 scales must be [{codes.shape[0]}] (one per output row), "
                         f"got {tuple(scales.shape)}")
    return codes.float() * scales.float()[:, None]


# ---------------------------------------------------------------------------------------------- int4

def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes ``[out, in]`` in 0..15 -> uint8 ``[out, in / 2]``: column 2i low nibble, 2i+1 high."""
    if q.dim() != 2 or q.shape[1] % 2:
        raise ValueError("int4 packing needs a 2-D code matrix with an even column count, "
                         f"got {tuple(q.shape)}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError(f"int4 codes must be in 0..15, got {int(q.min())}..{int(q.max())}")
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[out, in / 2]`` -> codes uint8 ``[out, in]`` in 0..15 (inverse of :func:`pack_int4`)."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError("packed int4 codes must be a 2-D uint8 tensor, "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=2).reshape(packed.shape[0], 2 * packed.shape[1])


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w [out, in]`` -> ``(packed uint8 [out, in/2], scales, mins float32 [out, in/g])``."""
    _check_weight(w, "int4")
    out, in_features = w.shape
    check_group_size(group_size, in_features, out)
    groups = w.detach().float().reshape(out, in_features // group_size, group_size)
    mins = groups.amin(dim=2)
    spread = groups.amax(dim=2) - mins
    scales = torch.where(spread > 0, spread / 15.0, torch.ones_like(spread))
    # Divide rather than multiply by 1/scale: for Q4_1-born weights (w - min) / scale is then an
    # exact integer, which is what makes the round trip bit-exact.
    q = torch.round((groups - mins[..., None]) / scales[..., None]).clamp_(0, 15)
    return pack_int4(q.reshape(out, in_features)), scales.contiguous(), mins.contiguous()


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """``q * scale + min`` per group, as float32 ``[out, in]``."""
    q = unpack_int4(packed)
    out, in_features = q.shape
    check_group_size(group_size, in_features, out)
    shape = (out, in_features // group_size)
    if scales.shape != shape or mins.shape != shape:
        raise ValueError(f"int4 scales and mins must be {list(shape)} for a [{out} x {in_features}] "
                         f"layer with group_size {group_size}, got {list(scales.shape)} and {list(mins.shape)}")
    groups = q.float().reshape(out, shape[1], group_size)
    return (groups * scales.float()[..., None] + mins.float()[..., None]).reshape(out, in_features)


# -------------------------------------------------------------------------------------- measurement

@dataclass(frozen=True)
class Reproduction:
    """How well a format stores a weight matrix."""
    format: str               # "int8", "int4 g32", ...
    exact_fraction: float     # weights that come back bit-identical after quantize -> dequantize
    relative_error: float     # ||w - w_hat||_F / ||w||_F (0 for a zero matrix stored exactly)
    max_abs_error: float


def reproduction(w: torch.Tensor, fmt: str, group_size: int | None = None) -> Reproduction:
    """Quantize ``w`` (float32 ``[out, in]``) in ``fmt`` ("int8" or "int4"), dequantize, compare.

    E.g. SmolLM2-135M's linear layers (GGUF Q4_1, dequantized): int4 g32 reproduces all 106 M
    weights exactly; int4 g64 27 % (8 % relative error); int8, one scale per row, 0.2 % (0.9 %
    relative error). Its embedding is Q8_0 in the GGUF and no format here matches it
    (benchmarks/bench_quant_kernels.py --exactness).
    """
    w = w.detach().float()
    if fmt == "int8":
        w_hat, name = dequantize_int8(*quantize_int8(w)), "int8"
    elif fmt == "int4":
        g = 32 if group_size is None else group_size
        w_hat, name = dequantize_int4(*quantize_int4(w, g), g), f"int4 g{g}"
    else:
        raise ValueError(f"format must be 'int8' or 'int4', got {fmt!r}")
    diff = w_hat - w
    norm = float(torch.linalg.vector_norm(w))
    err = float(torch.linalg.vector_norm(diff))
    return Reproduction(
        format=name,
        exact_fraction=float((w_hat == w).float().mean()) if w.numel() else 1.0,
        relative_error=err / norm if norm > 0 else err,
        max_abs_error=float(diff.abs().max()) if w.numel() else 0.0)
