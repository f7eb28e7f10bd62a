"""``speculative_config``: vLLM's keys, checked in one place.

    LLM("smollm2-135m", speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                            "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    LLM("smollm2-135m", speculative_config={"method": "draft_model", "model": "self",
                                            "num_speculative_tokens": 4})

``method="ngram"`` proposes by prompt lookup (spec/ngram.py). ``method="draft_model"`` runs a
smaller model with the same tokenizer (spec/draft.py): ``model`` is a name or path the loader
accepts, or ``"self"`` (the default) for the target's own checkpoint, made cheap by
``quantization`` (vLLM's key; ``"int4"`` by default for the self-draft) and/or by keeping only its
first ``draft_layers`` layers (a minserve addition). ``draft_num_kv_blocks`` (minserve) sizes the
draft's own KV pool; by default it has as many blocks as the target's. ``adaptive`` (minserve, on
by default) stops proposing when measured steps say it does not pay (spec/adaptive.py).
The dict may also come as a JSON string (``minserve serve --speculative-config '{...}'``, as vLLM).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
# A verify step is at most 8 rows per sequence (the fused C step's limit): the last token + 7.
MAX_SPECULATIVE_TOKENS = 7
SELF_DRAFT = "self"
COMMON_KEYS = {"method", "num_speculative_tokens", "adaptive"}
METHOD_KEYS = {"ngram": {"prompt_lookup_max", "prompt_lookup_min"},
               "draft_model": {"model", "quantization", "draft_layers", "draft_num_kv_blocks"}}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    adaptive: bool = True
    model: str = SELF_DRAFT                 # draft_model: a model name / path, or the target itself
    quantization: str | None = None         # draft_model: the draft's weight format
    draft_layers: int | None = None         # draft_model: keep only the first n layers
    draft_num_kv_blocks: int | None = None  # draft_model: None = as many as the target's pool

    @property
    def is_self_draft(self) -> bool:
        return self.method == "draft_model" and self.model == SELF_DRAFT


def _int(name: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"speculative_config[{name!r}] must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _as_dict(value) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                         f"'num_speculative_tokens': 4}}, got {value!r}")
    return value


def parse_speculative_config(value) -> SpeculativeConfig | None:
    """None, a dict or its JSON text -> a checked SpeculativeConfig (ValueError naming the key)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    value = _as_dict(value)
    method = value.get("method")
    if method not in METHODS:
        raise ValueError(f"speculative_config['method'] must be one of {list(METHODS)}, got {method!r}")
    known = COMMON_KEYS | METHOD_KEYS[method]
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative_config has unknown key(s) {unknown} for method {method!r}; "
                         f"known: {sorted(known)}")
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config needs 'num_speculative_tokens' (proposals per step, e.g. 4)")
    k = _int("num_speculative_tokens", value["num_speculative_tokens"], 1, MAX_SPECULATIVE_TOKENS)
    adaptive = value.get("adaptive", True)
    if not isinstance(adaptive, bool):
        raise ValueError(f"speculative_config['adaptive'] must be true or false, got {adaptive!r}")
    if method == "ngram":
        hi = _int("prompt_lookup_max", value.get("prompt_lookup_max", 4), 1, 64)
        lo = _int("prompt_lookup_min", value.get("prompt_lookup_min", 1), 1, hi)
        return SpeculativeConfig(method, k, hi, lo, adaptive)
    return _draft_model_config(value, k, adaptive)


def _draft_model_config(value: dict, k: int, adaptive: bool) -> SpeculativeConfig:
    model = value.get("model") or SELF_DRAFT  # None / "" / omitted: the target itself
    if not isinstance(model, str):
        raise ValueError(f"speculative_config['model'] must be a model name or path, or 'self' "
                         f"(the target's own checkpoint), got {model!r}")
    # The self-draft must be cheaper than the target: int4 unless told otherwise.
    quant = value.get("quantization", "int4" if model == SELF_DRAFT else None)
    if quant is not None:
        from minserve.quant.schemes import make_scheme  # lazy: quant imports the model layers
        try:
            make_scheme(quant, None)
        except ValueError as e:
            raise ValueError(f"speculative_config['quantization']: {e}") from None
    layers = value.get("draft_layers")
    if layers is not None:
        layers = _int("draft_layers", layers, 1, 1024)
    blocks = value.get("draft_num_kv_blocks")
    if blocks is not None:
        blocks = _int("draft_num_kv_blocks", blocks, 1, 1 << 24)
    if model == SELF_DRAFT and quant is None and layers is None:
        raise ValueError("speculative_config: a self-draft ('model': 'self') must be cheaper than the "
                         "target: give 'quantization' (e.g. 'int4') and/or 'draft_layers'")
    return SpeculativeConfig("draft_model", k, adaptive=adaptive, model=model, quantization=quant,
                             draft_layers=layers, draft_num_kv_blocks=blocks)
