"""The quantization formats and their settings by name, without PyTorch.

What the command lines offer as choices (``minserve serve --quantization``, the planner, the gate)
lives here, so that their ``--help`` and their argument errors answer without loading PyTorch; the
formats themselves are schemes.py's.
"""

QUANTIZATION_METHODS = ("int8", "int4", "int4-awq")
# quantization_config["lm_head"]: "quantize" (the format's own), "keep" (dense) or, for the int4
# formats, "int8" (llama.cpp's habit of a higher-precision output matrix). Defaults: measured (docs/engine/quantization.md).
LM_HEAD_CHOICES = {"int8": ("quantize", "keep"), "int4": ("int8", "quantize", "keep"),
                   "int4-awq": ("int8", "quantize", "keep")}
DEFAULT_LM_HEAD = {"int8": "quantize", "int4": "int8", "int4-awq": "int8"}
CONFIG_KEYS = {"int8": ("lm_head", "activations"), "int4": ("group_size", "fallback", "lm_head", "activations"),
               "int4-awq": ("group_size", "fallback", "lm_head", "activations", "calibration",
                            "max_calibration_tokens", "n_grid")}
