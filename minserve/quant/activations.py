"""Dynamic int8 activations: the torch reference of the W4A8 / W8A8 decode loops (kernels/quant_a8.h).

``quantization_config={"activations": "int8"}`` (with ``int8``, ``int4`` or ``int4-awq``) makes
the fused CPU decode step quantize each matrix's input rows on the fly, in blocks of 32 columns,
and multiply them into the weight codes with integer dot products (AVX-512 VNNI). Why: at batch 16
the weight-only loops are bound by float arithmetic, not by memory (docs/performance/quantization.md, "Where
fewer bytes became speed"); integer dot products do 4x more multiply-adds per instruction.

What it changes: per block of 32 input features of one row, ``d = max|x| / 127`` and
``a = round(x / d)`` in -127..127 (round half to even; an all-zero block gets ``d = 0``, codes 0),
the form of llama.cpp's Q8 blocks. Then, with ``k`` over blocks:

- int4 (``w = q * scale + min`` per group): ``y = sum_k scale * d_k * (q_k . a_k) + min * sum(x_k)``,
  the min term on the exact float sum of the block;
- int8 (``w = codes * scale`` per row): ``y = scale * sum_k d_k * (codes_k . a_k)``.

Only the fused CPU decode step runs this (decode and speculative-verify rows, every batch size, so
a request's tokens do not depend on its neighbours); prefill and the PyTorch path keep float
activations. These functions define the arithmetic; they are written to be read, not to be fast.
"""

from __future__ import annotations

import torch

from minserve.quant import formats

BLOCK = 32
ACTIVATIONS = ("float", "int8")   # quantization_config["activations"]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [B, in]`` (``in % 32 == 0``) -> ``(codes int8 [B, in], d [B, in/32], block sums [B, in/32])``."""
    if x.dim() != 2 or x.shape[1] % BLOCK:
        raise ValueError(f"int8 activations need [rows, in_features] with in_features a multiple of "
                         f"{BLOCK}, got {tuple(x.shape)}")
    blocks = x.detach().float().reshape(x.shape[0], -1, BLOCK)
    d = blocks.abs().amax(dim=2) / 127.0
    codes = torch.round(blocks / torch.where(d > 0, d, torch.ones_like(d))[..., None]).clamp_(-127, 127)
    return codes.to(torch.int8).reshape(x.shape), d, blocks.sum(dim=2)


def _block_dots(codes_w: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Exact integer dot products per 32-column block: ``[B, out, in/32]`` as float64."""
    w = codes_w.to(torch.int64).reshape(codes_w.shape[0], -1, BLOCK)
    x = a.to(torch.int64).reshape(a.shape[0], -1, BLOCK)
    return torch.einsum("okc,bkc->bok", w, x).double()


def int4_linear_a8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                   group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the W4A8 loop computes: ``[B, in] -> [B, out]`` float32."""
    a, d, xsum = quantize_activations(x)
    q = formats.unpack_int4(packed)
    per_group = group_size // BLOCK
    s = scales.double().repeat_interleave(per_group, dim=1)   # [out, blocks]
    m = mins.double().repeat_interleave(per_group, dim=1)
    dots = _block_dots(q, a)                                   # [B, out, blocks]
    y = (dots * s[None] * d.double()[:, None, :]).sum(2) + xsum.double() @ m.T
    return (y if bias is None else y + bias.double()).float()


def int8_linear_a8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the W8A8 loop computes: ``[B, in] -> [B, out]`` float32."""
    a, d, _ = quantize_activations(x)
    y = (_block_dots(codes, a) * d.double()[:, None, :]).sum(2) * scales.double()[None]
    return (y if bias is None else y + bias.double()).float()
