"""Quantization by construction: a scheme swaps a model's dense ``Linear`` layers for its own.

torchao's shape: build and load the dense model, then ``quantize_(model, scheme)`` walks its
:class:`~minserve.models.layers.Linear` layers and replaces each one the scheme accepts with the
module ``scheme.convert(name, linear)`` builds from it. Nothing in the model knows about formats:
a replacement keeps the ``Linear`` contract (``forward(x [T, in]) -> [T, out]`` in ``x``'s dtype,
``in_features`` / ``out_features``, ``descriptor()``, ``weight_bytes()``), and kernels that bind
weights read ``descriptor().format`` and refuse a format they do not implement.

Where formats plug in: ``minserve/quant/formats.py`` defines the tensor layouts (``quantize_int8``,
``quantize_int4``, ...); ``minserve/quant/schemes.py`` (and ``awq.py``) the :class:`QuantScheme`
subclasses that ``LLM(quantization=...)`` builds, whose ``convert`` packs the dense weight with
those functions into a module whose ``descriptor()`` reports the format (``"int8"``, ``"int4"``
with its group size, scales, mins), so ``weight_bytes()`` and the kernels see it. A scheme may
also ``check_model`` (refuse before converting anything) and ``prepare`` the dense model (AWQ
folds its scales); ``schemes.apply_quantization`` runs the three in order. This module is only
the mechanism; it knows no format.

The LM head policy (``QuantScheme.lm_head``):

* ``"keep"`` (default): the head stays a dense ``Linear``. A head tied to the embedding stays tied:
  one shared Parameter, one table in memory.
* ``"quantize"``: the head is converted (a scheme may give it another format than the blocks:
  int4 schemes store it in int8 by default, schemes.py). The head is the largest single
  matrix of a small model (SmolLM2-135M's 49152 x 576 head is a fifth of its weight bytes); when
  it was tied, it becomes its *own* quantized module (untied) while the embedding stays dense:
  a lookup reads a few rows, so quantizing the table would save no bandwidth, only accuracy.
  The model then holds the dense table plus the quantized head.

Quantize before binding kernels: a fused decoder holds raw pointers to the weights it bound.
"""

from __future__ import annotations

from torch import nn

from minserve.models.layers import Linear

LM_HEAD_POLICIES = ("keep", "quantize")


class QuantScheme:
    """A weight format, as the set of layers it converts and the module it converts them to.

    Subclasses set ``name`` (what ``quantization=`` would name; reported by descriptors) and
    ``lm_head`` (see the module docstring), and implement :meth:`convert`.
    """

    name: str = "none"
    lm_head: str = "keep"

    def convert(self, name: str, linear: Linear) -> nn.Module | None:
        """The module that replaces the loaded dense layer ``name`` (e.g. ``layers.3.mlp.down_proj``,
        ``lm_head``), or None to leave it dense. Must keep ``linear``'s contract (module docstring)."""
        raise NotImplementedError(f"{type(self).__name__}.convert")

    def label(self) -> str:
        """Every setting that changes the weights, e.g. ``int4 g32 lm_head=quantize``: the engine's
        start-up log and its prefix-cache fingerprint name the format by it."""
        return f"{self.name} lm_head={self.lm_head}"

    def check_model(self, model: nn.Module) -> None:
        """Raise ValueError, before anything is converted, for a model the scheme cannot convert
        whole (e.g. a group size that does not divide a layer): no half-quantized model is left."""

    def prepare(self, model: nn.Module, tokenizer) -> None:
        """Work on the dense model before any layer is swapped (AWQ calibrates and folds its scales
        here); the engine calls it through ``minserve.quant.apply_quantization``."""


def quantize_(model: nn.Module, scheme: QuantScheme) -> nn.Module:
    """Replace, in place, every dense ``Linear`` of ``model`` that ``scheme`` converts; returns ``model``.

    Layers are converted and swapped one at a time, so the dense copy of each can be freed as soon
    as it is replaced (when nothing else holds it) instead of all formats coexisting at once."""
    if scheme.lm_head not in LM_HEAD_POLICIES:
        raise ValueError(f"{type(scheme).__name__}.lm_head must be one of {', '.join(LM_HEAD_POLICIES)}, "
                         f"got {scheme.lm_head!r}")
    head = getattr(model, "lm_head", None)
    # Names, not modules: the list must not keep the replaced dense layers alive.
    names = [n for n, m in model.named_modules() if isinstance(m, Linear)
             and not (m is head and scheme.lm_head == "keep")]
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        new = scheme.convert(name, getattr(parent, attr))
        if new is not None:
            _check_contract(scheme, name, getattr(parent, attr), new)
            setattr(parent, attr, new)
    return model


def _check_contract(scheme: QuantScheme, name: str, old: Linear, new: nn.Module) -> None:
    # A wrong size would only surface as a shape error deep in a forward pass; say who broke it.
    if not callable(getattr(new, "descriptor", None)):
        raise TypeError(f"{type(scheme).__name__}.convert({name!r}) returned a {type(new).__name__} "
                        "without descriptor(); a replacement layer must describe its weights")
    d = new.descriptor()
    sizes = (getattr(new, "in_features", None), getattr(new, "out_features", None), d.in_features, d.out_features)
    if sizes != (old.in_features, old.out_features) * 2:
        raise ValueError(f"{type(scheme).__name__}.convert({name!r}) changed the layer's shape: "
                         f"in/out features {sizes[:2]}, descriptor {sizes[2:]}, expected "
                         f"({old.in_features}, {old.out_features})")
