"""Weight quantization: a scheme replaces dense ``Linear`` layers by construction (swap.py).

Format layouts (int8, int4: issue 11) live in ``minserve/quant/formats.py``; each is applied to a
model through a :class:`QuantScheme` subclass. See :mod:`minserve.quant.swap` for the contract a
replacement layer keeps and the LM head policy.
"""

from minserve.quant.swap import LM_HEAD_POLICIES, QuantScheme, quantize_

__all__ = ["LM_HEAD_POLICIES", "QuantScheme", "quantize_"]
