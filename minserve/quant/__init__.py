"""Weight quantization: a scheme replaces dense ``Linear`` layers by construction (swap.py).

``LLM(model, quantization="int8" | "int4" | "int4-awq", quantization_config={...})`` quantizes at
load time (schemes.py lists the formats and their settings; awq.py the activation-aware search).
Format layouts live in ``formats.py``; bytes per format (for the engine's log, its memory budget
and the planner) in ``sizes.py``. See :mod:`minserve.quant.swap` for the contract a replacement
layer keeps and the LM head policy.
"""

from typing import TYPE_CHECKING

from minserve import lazy

# Imported on first use (minserve/lazy.py): the command lines read the formats' names from
# names.py without loading PyTorch, which every module below needs.
__getattr__, __dir__ = lazy.exports(globals(), {
    **dict.fromkeys(("DEFAULT_LM_HEAD", "LM_HEAD_CHOICES", "QUANTIZATION_METHODS"), "minserve.quant.names"),
    **dict.fromkeys(("Int4Linear", "Int4Scheme", "Int8Linear", "Int8Scheme", "apply_quantization", "make_scheme",
                     "set_kernel"), "minserve.quant.schemes"),
    **dict.fromkeys(("WeightFootprint", "linear_bytes", "model_footprint", "resolve_group_size"),
                    "minserve.quant.sizes"),
    **dict.fromkeys(("LM_HEAD_POLICIES", "QuantScheme", "quantize_"), "minserve.quant.swap"),
})

if TYPE_CHECKING:
    from minserve.quant.names import DEFAULT_LM_HEAD, LM_HEAD_CHOICES, QUANTIZATION_METHODS
    from minserve.quant.schemes import (Int4Linear, Int4Scheme, Int8Linear, Int8Scheme, apply_quantization,
                                        make_scheme, set_kernel)
    from minserve.quant.sizes import WeightFootprint, linear_bytes, model_footprint, resolve_group_size
    from minserve.quant.swap import LM_HEAD_POLICIES, QuantScheme, quantize_

__all__ = ["LM_HEAD_POLICIES", "QuantScheme", "quantize_", "QUANTIZATION_METHODS", "DEFAULT_LM_HEAD",
           "LM_HEAD_CHOICES", "Int8Linear", "Int4Linear", "Int8Scheme", "Int4Scheme", "make_scheme", "apply_quantization",
           "set_kernel", "WeightFootprint", "linear_bytes", "model_footprint", "resolve_group_size"]
