"""Building blocks of the Llama family: linear layers, RMSNorm, rotary embeddings.

Every projection goes through :class:`Linear`, the one weight-storage interface of the model, so a
quantized format replaces it by construction and the roofline reads weight bytes from the layers.
The arithmetic of RMSNorm and RoPE deliberately follows Hugging Face transformers operation for
operation: our greedy outputs are checked token for token against it, and fp32 rounding differs
when the order of operations differs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """``y = x @ W.T + b`` over a dense weight; the base that quantized formats replace."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def weight_bytes(self) -> int:
        """Bytes this layer streams from memory per forward pass (the roofline's numerator)."""
        n = self.weight.numel() * self.weight.element_size()
        if self.bias is not None:
            n += self.bias.numel() * self.bias.element_size()
        return n


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused kernel instead of five small ops; bit-identical to the formula below in fp32.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Half precision: normalize in fp32 (the mean of squares overflows fp16), as transformers does.
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies of rotary embeddings, with optional linear or llama3 scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope scaling type {kind!r} is not supported; supported: default, linear, llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1 keeps high frequencies (short wavelengths, local order), divides low frequencies by
    # `factor` (long-range positions stretch to the longer context) and blends smoothly in between.
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (no per-step trigonometry)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        self._args = (head_dim, max_positions, theta, scaling)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin_signed", torch.empty(0), persistent=False)
        self.build_tables()

    def build_tables(self, device: torch.device | str = "cpu") -> None:
        """(Re)compute the tables in fp32 on ``device``. Called again after the model is cast to
        a half dtype, which would otherwise have rounded the tables too."""
        head_dim, max_positions, theta, scaling = self._args
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.cos = torch.cat((freqs, freqs), dim=-1).cos().to(device)
        # The sign of rotate_half is folded into the table: rotate_half(x) * sin equals
        # roll(x, half) * [-sin, sin] exactly (negation is exact), with one op fewer per layer.
        sin = freqs.sin()
        self.sin_signed = torch.cat((-sin, sin), dim=-1).to(device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of shape [T, 1, head_dim], broadcasting over heads."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate query/key vectors [T, heads, head_dim] by their positions (the "half-split" layout:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), as transformers' rotate_half computes it)."""
    return (x * cos) + (torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed)
