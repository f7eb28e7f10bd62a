"""Serving-budget planner: weight and KV bytes, sequences that fit, and a roofline of prefill/decode.

>>> from minserve.plan import plan
>>> p = plan("smollm2-135m", hardware="h100", precision="int4", context_len=4096, memory_budget="80GiB")
>>> print(p.table()); p.frame()

``minserve plan --help`` is the same from the command line.
"""

from minserve.plan.budget import PRECISIONS, WeightBytes, weight_bytes
from minserve.plan.hardware import DATASHEET, Hardware, get_hardware, known_hardware
from minserve.plan.planner import Plan, plan, plans_frame

__all__ = ["plan", "Plan", "plans_frame", "weight_bytes", "WeightBytes", "PRECISIONS",
           "Hardware", "DATASHEET", "get_hardware", "known_hardware"]
