"""``speculative_config``: vLLM's keys, checked in one place.

    LLM("smollm2-135m", speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                            "prompt_lookup_max": 4, "prompt_lookup_min": 2})

``method="ngram"`` proposes by prompt lookup (spec/ngram.py). ``adaptive`` (a minserve addition,
on by default) stops proposing when measured steps say it does not pay (spec/adaptive.py).
The dict may also come as a JSON string (``minserve serve --speculative-config '{...}'``, as vLLM).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    adaptive: bool = True


def _int(name: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"speculative_config[{name!r}] must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def parse_speculative_config(value) -> SpeculativeConfig | None:
    """None, a dict or its JSON text -> a checked SpeculativeConfig (ValueError naming the key)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                         f"'num_speculative_tokens': 4}}, got {value!r}")
    known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "adaptive"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative_config has unknown key(s) {unknown}; known: {sorted(known)}")
    method = value.get("method")
    if method not in METHODS:
        raise ValueError(f"speculative_config['method'] must be one of {list(METHODS)}, got {method!r}")
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config needs 'num_speculative_tokens' (proposals per step, e.g. 4)")
    k = _int("num_speculative_tokens", value["num_speculative_tokens"], 1, 7)
    hi = _int("prompt_lookup_max", value.get("prompt_lookup_max", 4), 1, 64)
    lo = _int("prompt_lookup_min", value.get("prompt_lookup_min", 1), 1, hi)
    adaptive = value.get("adaptive", True)
    if not isinstance(adaptive, bool):
        raise ValueError(f"speculative_config['adaptive'] must be true or false, got {adaptive!r}")
    return SpeculativeConfig(method, k, hi, lo, adaptive)
