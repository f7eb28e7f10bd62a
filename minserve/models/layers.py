"""Building blocks of the Llama family: linear layers, embedding, RMSNorm, rotary embeddings.

Every projection goes through :class:`Linear`, the one weight-storage interface of the model, so a
quantized format replaces it by construction and the roofline reads weight bytes from the layers.
Layers with weights are built from shapes (possibly on the ``meta`` device, without memory) and
then loaded through ``load(tensor, shard=None, param="weight")``.
The arithmetic of RMSNorm and RoPE deliberately follows Hugging Face transformers operation for
operation: our greedy outputs are checked token for token against it, and fp32 rounding differs
when the order of operations differs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from minserve.kernels import bf16_gemm, token_ops
from minserve.models import gemm
from minserve.models.weights import DENSE, WeightDescriptor, load_rows


class Linear(nn.Module):
    """``y = x @ W.T + b`` over a dense ``[out_features, in_features]`` weight.

    The one weight-storage interface of the model. Built from shapes, then loaded
    (:meth:`load`); a quantized format replaces a whole ``Linear`` by construction
    (:func:`minserve.quant.quantize_`) with a module that keeps this contract:
    ``forward(x [T, in]) -> [T, out]``, ``in_features`` / ``out_features``, :meth:`descriptor`
    and :meth:`weight_bytes`.
    """

    # The batch-invariant mode (engine/batch_invariance.py) sets it: products through C loops whose
    # sum for a row does not depend on the other rows (oneDNN's and MKL's blocking does).
    row_invariant: bool = False

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__()
        # Sizes are kept as plain ints, not read off the weight: a quantized replacement packs its
        # codes in a format-specific shape, and a meta-built layer has no data yet.
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self.bf16_halves: tuple[torch.Tensor, torch.Tensor] | None = None   # split_weight()

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Linear":
        """A loaded layer around existing tensors (tests, experiments); shares their storage."""
        layer = cls(weight.shape[1], weight.shape[0], bias is not None, weight.dtype, "meta")
        layer.load(weight)
        if bias is not None:
            layer.load(bias, param="bias")
        return layer

    def shard_rows(self, shard: str | None) -> tuple[int, int]:
        """(first row, row count) of a named shard of the output; a plain layer has none."""
        if shard is not None:
            raise ValueError(f"{type(self).__name__} has no shards, got shard={shard!r}")
        return 0, self.out_features

    def load(self, tensor: torch.Tensor, shard: str | None = None, param: str = "weight") -> None:
        """Load a checkpoint tensor into ``param`` ("weight" or "bias"), or into one shard's rows.

        Raises ValueError naming the expected shape when the tensor does not fit."""
        target = self.weight if param == "weight" else self.bias if param == "bias" else None
        if target is None:
            raise ValueError(f"{type(self).__name__} has no {param!r} to load")
        first, rows = self.shard_rows(shard)
        if tensor.shape[0] != rows:
            where = f"shard {shard!r} of " if shard else ""
            raise ValueError(f"expected {rows} rows for {where}{param} "
                             f"[{self.out_features} x {self.in_features}], got {tuple(tensor.shape)}")
        load_rows(target, tensor, first)
        if param == "weight" and self.bf16_halves is not None:
            self.split_weight()   # halves of the weight as it now is

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_invariant:   # the batch-invariant mode: a row's sum whatever the row count
            from minserve.kernels.decode import row_invariant_linear
            return row_invariant_linear(x, self.weight, self.bias)
        # oneDNN on CPU where it is faster; the bf16 halves at fp32_matmul_precision "high" (gemm.py)
        return gemm.linear(x, self.weight, self.bias, self.bf16_halves)

    def split_weight(self) -> None:
        """Keep the float32 weight also as two bf16 halves (kernels/bf16_gemm.py's split), so
        products of many rows run as three bf16 products on AMX tiles: an engine built with
        ``fp32_matmul_precision="high"`` calls this once the weights are loaded. A second copy of
        the weight's bytes; the float32 weight stays for one-row products and the fused step's
        batch 1."""
        self.bf16_halves = bf16_gemm.split(self.weight.detach())

    def descriptor(self) -> WeightDescriptor:
        """What the weight is (format, shapes, tensors), for kernels that bind it directly."""
        return WeightDescriptor(DENSE, self.in_features, self.out_features, self.weight.data,
                                None if self.bias is None else self.bias.data, bf16_halves=self.bf16_halves)

    def weight_bytes(self) -> int:
        """Bytes this layer streams from memory per forward pass (the roofline's numerator)."""
        return self.descriptor().nbytes

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class MergedLinear(Linear):
    """Several projections of the same input stacked by rows: one GEMM instead of several.

    q/k/v (``shards={"q": 576, "k": 192, "v": 192}``) and gate/up are merged this way. The
    checkpoint stores each projection apart; ``load(tensor, shard="k")`` writes it into its rows
    (vLLM's stacked-parameter loading), so the model never concatenates raw tensors itself.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__(in_features, sum(shards.values()), bias, dtype, device)
        self.shards: dict[str, tuple[int, int]] = {}
        first = 0
        for name, rows in shards.items():
            self.shards[name] = (first, rows)
            first += rows

    def shard_rows(self, shard: str | None) -> tuple[int, int]:
        if shard not in self.shards:
            raise ValueError(f"shard must be one of {', '.join(self.shards)}; got {shard!r}")
        return self.shards[shard]


class Embedding(nn.Module):
    """Token id -> row of a ``[vocab, hidden]`` table. Only the looked-up rows are read, which is
    why a quantization scheme leaves it dense even when it quantizes the (tied) LM head."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype, device=device),
                                   requires_grad=False)

    def load(self, tensor: torch.Tensor, shard: str | None = None, param: str = "weight") -> None:
        load_rows(self.weight, tensor)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}"


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` of a merged [T, 2 x inter] gate/up product -> [T, inter]: one
    C pass on the CPU for many tokens (kernels/token_ops.py), PyTorch's two ops otherwise."""
    out = token_ops.silu_mul(gate_up, inter)
    if out is None:
        gate, up = gate_up.split(inter, dim=-1)
        out = F.silu(gate) * up
    return out


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def load(self, tensor: torch.Tensor, shard: str | None = None, param: str = "weight") -> None:
        load_rows(self.weight, tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused kernel instead of five small ops; bit-identical to the formula below in fp32.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Half precision: normalize in fp32 (the mean of squares overflows fp16), as transformers does:
        # one C pass for many bf16 rows on the CPU (kernels/token_ops.py), the same two roundings.
        out = token_ops.rms_norm_bf16(x, self.weight, self.eps)
        if out is not None:
            return out
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
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), as transformers' rotate_half computes it).

    On the CPU, a chunk of many tokens is rotated *in place* by one C pass (kernels/token_ops.py):
    use the returned tensor, and do not read ``x`` afterwards."""
    rotated = token_ops.rope_(x, cos, sin_signed)
    if rotated is not None:
        return rotated
    return (x * cos) + (torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed)
