"""Weight descriptors: what a linear layer's weight *is*, for code that reads it without PyTorch.

A dense layer's weight is one ``[out_features, in_features]`` matrix; a quantized one is codes plus
scales (and zero points, per group). Kernels that bind raw pointers (the fused C decode step,
Triton later) must know which, or they would read int8 codes as float32. Every :class:`Linear`
exposes a :class:`WeightDescriptor`; a kernel checks the ``format`` (and dtype) it implements and
refuses anything else with the reason. The roofline reads :attr:`WeightDescriptor.nbytes`.

This module also holds :func:`load_rows`, the one way a checkpoint tensor gets into a built
parameter (layers are built from shapes first, then loaded; see ``LlamaForCausalLM.load_weights``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minserve.kernels.formats import DENSE  # noqa: F401  (the kernels' name for a plain matrix)


@dataclass(frozen=True)
class WeightDescriptor:
    format: str                       # "dense", or a quantized format ("int8", "int4", ...)
    in_features: int
    out_features: int
    data: torch.Tensor                # dense: [out, in]; quantized: the codes, format-specific layout
    bias: torch.Tensor | None = None  # [out], in the compute dtype
    scales: torch.Tensor | None = None
    # int4 (GGUF Q4_1's form, minserve/quant/formats.py): the group minimum m, a float, in
    # w = q * scale + m; not an integer zero point z in (q - z) * scale.
    zero_points: torch.Tensor | None = None
    group_size: int | None = None     # input features per scale (None: one scale per output row)
    # How the input rows meet the weights: "float", or "int8" (quantized on the fly in blocks of
    # 32 and multiplied as integers: W8A8 / W4A8, minserve/quant/activations.py).
    activations: str = "float"
    # Dense float32 at fp32_matmul_precision "high" (layers.Linear.split_weight): the weight also as
    # two bf16 halves, which products of many rows multiply on AMX tiles. Not in nbytes: one row
    # still streams the float32 matrix.
    bf16_halves: tuple[torch.Tensor, torch.Tensor] | None = None
    # int8 activations on a CPU with AVX-512 VNNI (quant.schemes's tile_for_a8):
    # the same weight again in the integer loops' tile order, which they read instead of the codes.
    # Not in nbytes either: a product reads one copy or the other, the same number of bytes.
    a8_tiles: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        """Bytes read per forward pass: codes (or the dense matrix), scales, zero points, bias."""
        parts = (self.data, self.scales, self.zero_points, self.bias)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def describe(self) -> str:
        """e.g. ``dense float32 [576 x 1536]`` or ``int4 g32 [576 x 1536]``: for error messages."""
        kind = f"{self.format} {str(self.dtype).removeprefix('torch.')}" if self.format == DENSE else (
            f"{self.format}" + (f" g{self.group_size}" if self.group_size else ""))
        act = " a8" if self.activations == "int8" else ""
        return f"{kind}{act} [{self.out_features} x {self.in_features}]"


def load_rows(param: torch.nn.Parameter, tensor: torch.Tensor, start: int = 0) -> None:
    """Write ``tensor`` into rows ``[start, start + len(tensor))`` of ``param`` (all of it by default).

    Two cases, chosen by where the parameter lives:

    * a real parameter (built on a device): the rows are copied in, converting the dtype, so the
      caller may drop its tensor right after (vLLM's weight_loader semantics);
    * a ``meta`` parameter (built without memory, ``device="meta"``): it is materialized on the
      tensor's device. A whole-parameter load *adopts* the tensor (no copy when the dtype already
      matches), so a model loads without holding two full copies of its weights; a first row-slice
      (a fused q/k/v or gate/up shard) allocates the full parameter and copies its rows.

    Materializing swaps the tensor *inside* the Parameter object (``torch.utils.swap_tensors``)
    rather than assigning a new Parameter: a parameter shared by two modules (the tied LM head and
    the embedding) stays one object, so loading it once loads both.
    """
    rows = tensor.shape[0] if tensor.dim() else 0
    expect = (rows, *param.shape[1:])
    if tuple(tensor.shape) != expect or start + rows > param.shape[0]:
        raise ValueError(f"shape {tuple(tensor.shape)} does not fit rows [{start}, {start + rows}) "
                         f"of a parameter of shape {tuple(param.shape)}")
    if param.is_meta:
        whole = start == 0 and rows == param.shape[0]
        data = (tensor.to(param.dtype).contiguous() if whole
                else torch.empty(param.shape, dtype=param.dtype, device=tensor.device))
        torch.utils.swap_tensors(param, torch.nn.Parameter(data, requires_grad=False))
        if whole:
            return
    with torch.no_grad():
        param.data[start:start + rows].copy_(tensor)
