"""The weight formats an engine can be asked for: ``LLM(model, quantization=..., quantization_config=...)``.

============  ====================================================================================
``int8``      weight-only (W8A16), per-output-channel symmetric: int8 codes, a float32 scale per row
``int4``      weight-only (W4A16), group-wise asymmetric (GGUF Q4_1's ``q * scale + min``), two codes
              a byte; ``quantization_config={"group_size": 32 | 64 | 128}`` (default 32)
``int4-awq``  ``int4`` after activation-aware scaling on a calibration set that ships with the
              project (minserve/quant/awq.py)
============  ====================================================================================

``quantization_config`` keys (vLLM passes a checkpoint's quantization config as a dict; ours is the
recipe applied at load time): ``group_size`` (int4*), ``fallback`` (int4*: a layer the group size
does not divide takes the largest allowed size that does, instead of a ValueError), ``lm_head``
("quantize" | "keep", and "int8" for the int4 formats: see below), ``activations`` ("float", the
default, or "int8": decode steps on the fused CPU path quantize each quantized matrix's inputs in
blocks of 32 and use integer dot products, W8A8 / W4A8, see minserve/quant/activations.py), and for int4-awq
``calibration`` (a path to a ``.jsonl`` of ``{"text"}`` rows, or a list of strings),
``max_calibration_tokens`` and ``n_grid``.

The LM head (``lm_head``), measured both ways on SmolLM2-135M (docs/engine/quantization.md): int8
quantizes it (``"quantize"``: the same agreement with fp32 as a dense head, 81 MiB fewer bytes per
token); int4 and int4-awq store it in int8 (``"int8"``): an int4 head is the costliest single layer
(with int4 g32, whose blocks reproduce SmolLM2 exactly, it alone adds +6 % perplexity and a mean
KL of 0.057; an int8 head 0.0013), and a dense one is the largest matrix read per decode step.
A quantized head tied to the embedding gets its own module; the dense embedding table stays
resident beside it for the lookup.

Each quantized layer keeps the ``Linear`` contract (swap.py) and runs, by device: CPU -> our C
kernels (kernels/quant.py); CUDA with Triton -> the W8A16 / W4A16 Triton kernels; anything else ->
dequantize + ``F.linear`` (the reference, also used when ``layer.kernel = "reference"``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minserve.models.layers import Linear
from minserve.models.weights import WeightDescriptor
from minserve.quant import activations, formats
from minserve.quant.activations import ACTIVATIONS
from minserve.quant.names import CONFIG_KEYS, DEFAULT_LM_HEAD, LM_HEAD_CHOICES, QUANTIZATION_METHODS  # noqa: F401
from minserve.quant.sizes import INT4_DEFAULT_GROUP_SIZE, resolve_group_size
from minserve.quant.swap import QuantScheme, quantize_

KERNELS = ("auto", "reference")


class _QuantLinear(nn.Module):
    """What Int8Linear and Int4Linear share: sizes, bias, the kernel choice, float32 scales."""

    kernel: str = "auto"   # "reference": dequantize + F.linear everywhere (tests compare the two)
    # "int8": inputs quantized in blocks of 32 on every path (minserve/quant/activations.py);
    # set by the scheme (quantization_config["activations"]) for layers with in_features % 32 == 0.
    activations: str = "float"
    # The batch-invariant mode (engine/batch_invariance.py): float inputs take the C loops at every
    # row count, not the dequantized tiles of PREFILL_MIN_ROWS+ rows, whose GEMM blocks by rows.
    row_invariant: bool = False

    def __init__(self, linear: Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def _apply(self, fn, recurse=True):
        # model.to(dtype=bfloat16) casts float tensors; the scales and mins are part of the format
        # (float32, formats.py) and every kernel reads them as such: move them, never cast them.
        keep = {n: b for n, b in self._buffers.items() if n in ("scales", "mins") and b is not None}
        super()._apply(fn, recurse)
        for n, b in keep.items():  # where fn sends an empty tensor from b's device is where b goes
            self._buffers[n] = b.to(fn(b.new_empty(0)).device)
        return self

    # The weight also in the int8-activation loops' tile order (tile_for_a8), or None.
    a8_tiles: torch.Tensor | None = None

    def tile_for_a8(self) -> bool:
        """Keep the weight also in the int8-activation loops' tile order (kernels/quant_a8_tiles.h),
        which every product of this layer then reads instead of transposing its rows on each call:
        the same outputs, bit for bit, faster at every row count, for a second copy of the weight's
        bytes. An engine with int8 activations calls this once its weights are in place
        (minserve/engine/model_runner.py). False where those loops are not built here (no AVX-512
        VNNI) or the layer's inputs stay float: nothing changes then."""
        bits, codes, scales, mins, group = self._a8_weight()
        if self.activations != "int8" or codes.device.type != "cpu":
            return False
        from minserve.kernels.quant import a8_tiles
        self.a8_tiles = a8_tiles(bits, codes, scales, mins, group)
        return self.a8_tiles is not None

    def _a8_weight(self) -> tuple:
        """(bits, codes, scales, mins, group size) as kernels/quant.py's linear_a8 takes them."""
        raise NotImplementedError

    def _path(self, x: torch.Tensor) -> str:
        if self.kernel == "reference":
            return "reference"
        if x.device.type == "cpu":
            return "cpu"
        from minserve.kernels import triton as tk
        return "triton" if x.device.type == "cuda" and tk.available() else "reference"

    def weight_bytes(self) -> int:
        return self.descriptor().nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path, x2 = self._path(x), x.reshape(-1, self.in_features)
        if self.activations == "int8":  # C loops on the CPU; elsewhere the torch reference (slow)
            bias = None if self.bias is None else self.bias.float()
            y = self._a8(x2.float().contiguous(), bias, path == "cpu").to(x.dtype)
        elif path == "cpu":  # the C kernels take float32 (a bf16 CPU model converts at the edges)
            bias = None if self.bias is None else self.bias.float()
            y = self._cpu(x2.float().contiguous(), bias, "fused" if self.row_invariant else "auto").to(x.dtype)
        elif path == "triton":
            y = self._triton(x2.contiguous())
        else:
            y = F.linear(x2, self.dequantize().to(x.dtype), self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.descriptor().describe()}, bias={self.bias is not None}, kernel={self.kernel}"


class Int8Linear(_QuantLinear):
    """W8A16: int8 codes ``[out, in]``, a float32 scale per output row (formats.quantize_int8)."""

    def __init__(self, linear: Linear):
        super().__init__(linear)
        codes, scales = formats.quantize_int8(linear.weight.detach())
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)

    def dequantize(self) -> torch.Tensor:
        return formats.dequantize_int8(self.codes, self.scales)

    def _cpu(self, x, bias, path):
        from minserve.kernels.quant import int8_linear
        return int8_linear(x, self.codes, self.scales, bias, path=path)

    def _a8_weight(self) -> tuple:
        return 8, self.codes, self.scales, None, 0

    def _a8(self, x, bias, c_kernel: bool):
        if c_kernel:
            from minserve.kernels.quant import linear_a8
            return linear_a8(x, *self._a8_weight(), bias, tiles=self.a8_tiles)
        return activations.int8_linear_a8(x, self.codes, self.scales, bias)

    def _triton(self, x):
        from minserve.kernels.triton import w8a16_matmul
        return w8a16_matmul(x, self.codes, self.scales, self.bias)

    def descriptor(self) -> WeightDescriptor:
        return WeightDescriptor("int8", self.in_features, self.out_features, self.codes,
                                None if self.bias is None else self.bias.data, scales=self.scales,
                                activations=self.activations, a8_tiles=self.a8_tiles)


class Int4Linear(_QuantLinear):
    """W4A16: packed codes ``[out, in/2]``, float32 scales and mins ``[out, in/g]`` (quantize_int4)."""

    def __init__(self, linear: Linear, group_size: int, weight: torch.Tensor | None = None):
        super().__init__(linear)
        self.group_size = group_size
        w = linear.weight.detach() if weight is None else weight  # AWQ passes W * s
        packed, scales, mins = formats.quantize_int4(w, group_size)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)

    def dequantize(self) -> torch.Tensor:
        return formats.dequantize_int4(self.packed, self.scales, self.mins, self.group_size)

    def _cpu(self, x, bias, path):
        from minserve.kernels.quant import int4_linear
        return int4_linear(x, self.packed, self.scales, self.mins, self.group_size, bias, path=path)

    def _a8_weight(self) -> tuple:
        return 4, self.packed, self.scales, self.mins, self.group_size

    def _a8(self, x, bias, c_kernel: bool):
        if c_kernel:
            from minserve.kernels.quant import linear_a8
            return linear_a8(x, *self._a8_weight(), bias, tiles=self.a8_tiles)
        return activations.int4_linear_a8(x, self.packed, self.scales, self.mins, self.group_size, bias)

    def _triton(self, x):
        from minserve.kernels.triton import w4a16_matmul
        return w4a16_matmul(x, self.packed, self.scales, self.mins, self.group_size, self.bias)

    def descriptor(self) -> WeightDescriptor:
        return WeightDescriptor("int4", self.in_features, self.out_features, self.packed,
                                None if self.bias is None else self.bias.data, scales=self.scales,
                                zero_points=self.mins, group_size=self.group_size,
                                activations=self.activations, a8_tiles=self.a8_tiles)


class Int8Scheme(QuantScheme):
    name = "int8"

    def __init__(self, lm_head: str = DEFAULT_LM_HEAD["int8"], activations: str = "float"):
        if lm_head not in LM_HEAD_CHOICES[self.name]:
            raise ValueError(f"quantization_config['lm_head'] must be one of {list(LM_HEAD_CHOICES[self.name])} "
                             f"for quantization={self.name!r}, got {lm_head!r}")
        if activations not in ACTIVATIONS:
            raise ValueError(f"quantization_config['activations'] must be one of {list(ACTIVATIONS)}, "
                             f"got {activations!r}")
        self.head = lm_head  # the config's choice; swap.py's policy below is whether to convert it
        self.lm_head = "keep" if lm_head == "keep" else "quantize"
        # "int8": the fused CPU decode step quantizes each quantized matrix's input rows
        # (minserve/quant/activations.py); the weights themselves are the same either way.
        self.activations = activations

    def convert(self, name: str, linear: Linear) -> nn.Module:
        return self._with_activations(Int8Linear(linear))

    def _with_activations(self, layer: _QuantLinear) -> _QuantLinear:
        # int8 activations come in blocks of 32 columns; a layer they do not divide keeps float ones.
        if self.activations == "int8" and layer.in_features % activations.BLOCK == 0:
            layer.activations = "int8"
        return layer

    def label(self) -> str:
        return f"{self.name} lm_head={self.head}{self._act_label()}"

    def _act_label(self) -> str:   # decode numerics differ, so prefix-cache fingerprints must too
        return " act=int8" if self.activations == "int8" else ""


class Int4Scheme(Int8Scheme):
    name = "int4"

    def __init__(self, group_size: int = INT4_DEFAULT_GROUP_SIZE, fallback: bool = False,
                 lm_head: str = DEFAULT_LM_HEAD["int4"], activations: str = "float"):
        super().__init__(lm_head, activations)
        resolve_group_size(group_size, group_size)  # an allowed size at all (ValueError otherwise)
        self.group_size, self.fallback = group_size, fallback

    def group_size_of(self, name: str, linear: Linear) -> int:
        return resolve_group_size(self.group_size, linear.in_features, self.fallback,
                                  f"layer {name!r} [{linear.out_features} x {linear.in_features}]")

    def convert(self, name: str, linear: Linear) -> nn.Module:
        if name == "lm_head" and self.head == "int8":
            return self._with_activations(Int8Linear(linear))
        return self._with_activations(Int4Linear(linear, self.group_size_of(name, linear)))

    def label(self) -> str:
        return (f"{self.name} g{self.group_size}{' fallback' if self.fallback else ''} lm_head={self.head}"
                f"{self._act_label()}")

    def check_model(self, model: nn.Module) -> None:
        """Every group size resolves before anything is converted: a refused layer must not
        leave a half-quantized model behind."""
        head = getattr(model, "lm_head", None)
        for name, m in model.named_modules():
            if isinstance(m, Linear) and not (m is head and self.head != "quantize"):
                self.group_size_of(name, m)


def make_scheme(quantization: str, quantization_config: dict | None = None) -> QuantScheme:
    """The scheme ``LLM(quantization=..., quantization_config=...)`` names; ValueError naming the
    argument for an unknown format, key or value."""
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATION_METHODS)} (or None for the "
                         f"model's own dtype), got {quantization!r}")
    cfg = dict(quantization_config or {})
    unknown = sorted(set(cfg) - set(CONFIG_KEYS[quantization]))
    if unknown:
        raise ValueError(f"quantization_config key(s) {unknown} do not apply to quantization="
                         f"{quantization!r}; known: {list(CONFIG_KEYS[quantization])}")
    if not isinstance(cfg.get("fallback", False), bool):
        raise ValueError(f"quantization_config['fallback'] must be True or False, got {cfg['fallback']!r}")
    if quantization == "int8":
        return Int8Scheme(**cfg)
    if quantization == "int4":
        return Int4Scheme(**cfg)
    from minserve.quant.awq import AWQScheme
    return AWQScheme(**cfg)


def apply_quantization(model: nn.Module, scheme: QuantScheme, tokenizer=None) -> nn.Module:
    """``scheme.check_model``, ``scheme.prepare`` (AWQ's calibration), then
    :func:`~minserve.quant.swap.quantize_`: what the engine does at load time."""
    scheme.check_model(model)
    scheme.prepare(model, tokenizer)
    return quantize_(model, scheme)


def set_kernel(model: nn.Module, kernel: str) -> None:
    """Run every quantized layer through ``kernel`` ("auto": by device; "reference": dequantize +
    F.linear), e.g. to compare our kernels with the reference on the same model."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {list(KERNELS)}, got {kernel!r}")
    for m in model.modules():
        if isinstance(m, _QuantLinear):
            m.kernel = kernel
