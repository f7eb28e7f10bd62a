"""Bytes per format: what one linear layer costs, which group size it gets, what a model holds.

One home for the arithmetic that the engine logs, the KV budget subtracts and the planner
(minserve/plan) predicts, so the three can never disagree:

* :func:`linear_bytes`: bytes of one ``[out x in]`` layer in a format, exactly as the layouts of
  :mod:`minserve.quant.formats` store it (scales and int4 mins are float32 whatever the
  activation dtype: every kernel reads them as float32);
* :func:`resolve_group_size`: the int4 group size a layer gets (the requested one, or with
  ``fallback`` the largest allowed one that divides the layer; else a ValueError);
* :func:`model_footprint`: a built model's bytes, *resident* (every weight tensor in memory, once)
  and *streamed* (read by one decode step: every linear layer whole, the embedding only as a few
  rows, so not counted). Untying a quantized LM head from a dense embedding makes the two differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minserve.models.layers import RMSNorm, RotaryEmbedding
from minserve.quant.formats import INT4_GROUP_SIZES

SCALE_BYTES = 4  # float32 scales and mins (formats.py)
INT4_DEFAULT_GROUP_SIZE = 32  # Q4_1's block: SmolLM2's weights come back bit for bit (docs/engine/quantization.md)


def resolve_group_size(group_size: int, in_features: int, fallback: bool = False,
                       layer: str = "a layer", argument: str = "quantization_config['group_size']") -> int:
    """The int4 group size of a layer with ``in_features`` inputs.

    ``group_size`` if it divides ``in_features``. Otherwise, with ``fallback``, the largest allowed
    size below it that does (llama.cpp's answer to a row its block does not divide: a per-tensor
    fallback); without it, a ValueError naming the layer, the size and the argument."""
    if isinstance(group_size, bool) or group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"{argument} must be one of {list(INT4_GROUP_SIZES)}, got {group_size!r}")
    if in_features % group_size == 0:
        return group_size
    fits = [g for g in INT4_GROUP_SIZES if in_features % g == 0]
    smaller = [g for g in fits if g < group_size]
    if fallback and smaller:
        return max(smaller)
    hint = (f"use one of {fits}, or add 'fallback': True to quantization_config to take the largest "
            "of those per layer" if fits else "no int4 group size divides it; use int8")
    raise ValueError(f"{argument}={group_size} does not divide in_features={in_features} of {layer}; {hint}")


def linear_bytes(out_features: int, in_features: int, fmt: str, group_size: int | None = None,
                 dtype_bytes: int = 4, bias: bool = False) -> tuple[int, int]:
    """(codes or dense matrix, scales + mins + bias) bytes of one layer, as the formats store it.

    ``fmt``: "dense" (the matrix in the activation dtype of ``dtype_bytes``), "int8" (1 byte per
    weight + a float32 scale per row) or "int4" (half a byte + a float32 scale and min per group
    of ``group_size`` inputs, which must divide ``in_features``: see :func:`resolve_group_size`).
    A bias stays in the activation dtype."""
    n, extra = out_features * in_features, out_features * dtype_bytes if bias else 0
    if fmt == "dense":
        return n * dtype_bytes, extra
    if fmt == "int8":
        return n, out_features * SCALE_BYTES + extra
    if fmt == "int4":
        if not group_size or in_features % group_size or in_features % 2:
            raise ValueError(f"int4 needs a group_size dividing in_features={in_features}, got {group_size!r}")
        return n // 2, out_features * (in_features // group_size) * 2 * SCALE_BYTES + extra
    raise ValueError(f"format must be 'dense', 'int8' or 'int4', got {fmt!r}")


@dataclass
class WeightFootprint:
    """A built model's weight bytes (see the module docstring for resident vs streamed)."""
    resident_bytes: int
    streamed_bytes: int                                            # per decode step (= weight_bytes())
    by_format: dict[str, int] = field(default_factory=dict)        # streamed bytes per layer format
    embedding_bytes: int = 0                                       # resident, not streamed

    def summary(self) -> str:
        """e.g. ``int4 g32 95.1 MiB + dense float32 0.1 MiB; 101.3 MiB streamed per token, 209.3 MiB resident``."""
        parts = " + ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(self.by_format.items(), key=lambda kv: -kv[1]))
        return (f"{parts}; {self.streamed_bytes / 2**20:.1f} MiB streamed per token, "
                f"{self.resident_bytes / 2**20:.1f} MiB resident")


def _label(d) -> str:
    if d.format == "dense":
        return f"dense {str(d.dtype).removeprefix('torch.')}"
    return d.format + (f" g{d.group_size}" if d.group_size else "")


def model_footprint(model: torch.nn.Module) -> WeightFootprint:
    """Resident and streamed weight bytes of a Llama model (dense or quantized).

    Streamed: what ``LlamaForCausalLM.weight_bytes()`` counts (every layer's descriptor, norms).
    Resident: every parameter and buffer of a weight module counted once by storage (a tied head
    and its embedding are one table), which includes a dense embedding kept beside an untied
    quantized head, a float32 layer's bf16 halves (fp32_matmul_precision "high") and an int4
    layer's tiles for int8 activations (a second copy each). Rotary tables are position caches,
    not weights: not counted."""
    streamed, by_format, copies = 0, {}, []
    for m in model.modules():
        if callable(getattr(m, "descriptor", None)):
            d = m.descriptor()
            by_format[_label(d)] = by_format.get(_label(d), 0) + d.nbytes
            streamed += d.nbytes
            copies += d.bf16_halves or ()
            copies += () if d.a8_tiles is None else (d.a8_tiles,)
    norms = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, RMSNorm))
    rotary = {t.data_ptr() for m in model.modules() if isinstance(m, RotaryEmbedding) for t in m.buffers()}
    storages = {}
    # plus the bf16 halves a float32 layer keeps at fp32_matmul_precision "high" and the tiles an
    # int4 layer with int8 activations keeps (its descriptor's)
    for t in list(model.parameters()) + list(model.buffers()) + copies:
        if t.data_ptr() not in rotary and t.numel():
            storages[t.data_ptr()] = t.numel() * t.element_size()
    emb = model.embed_tokens.weight
    head = model.lm_head.descriptor().data if hasattr(model, "lm_head") else None
    embedding = 0 if head is not None and head.data_ptr() == emb.data_ptr() else emb.numel() * emb.element_size()
    return WeightFootprint(sum(storages.values()), streamed + norms, by_format, embedding)
