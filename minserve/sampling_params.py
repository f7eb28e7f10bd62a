"""Per-request sampling parameters, with vLLM's public names and semantics (a subset).

Code written against ``vllm.SamplingParams`` keeps working here for the fields listed below; fields
vLLM has and we do not (``best_of``, ``truncate_prompt_tokens``, ...) are absent on purpose, so
passing one fails loudly (``TypeError``) instead of being silently ignored.
"""

from __future__ import annotations

import copy
import enum
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

# Below this temperature a request is greedy. Same constant as vLLM (_SAMPLING_EPS): dividing
# logits by a smaller number overflows nothing useful and only amplifies rounding noise.
SAMPLING_EPS = 1e-5
# Upper bound on the number of top logprobs a request may ask for (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
# Upper bound on ``n`` (samples per prompt): the OpenAI API's own limit.
MAX_N = 128
# vLLM's OpenAI server clamps each logit_bias value into this range (as OpenAI documents it).
LOGIT_BIAS_LIMIT = 100.0


class RequestOutputKind(enum.IntEnum):
    """What each streamed ``RequestOutput`` carries (same values as vLLM)."""

    CUMULATIVE = 0  # all text/tokens generated so far, every time
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # nothing until the request finishes, then everything


class SamplingType(enum.IntEnum):
    """How the sampler treats a request (same names as vLLM)."""

    GREEDY = 0  # argmax; no randomness, no generator needed
    RANDOM = 1  # random draw from the engine's shared generator
    RANDOM_SEED = 2  # random draw from the request's own seeded generator


def _int(name: str, value: object, *, none_ok: bool = False) -> int | None:
    """Return ``value`` as a plain int; reject bools, floats and strings (``max_tokens="5"``)."""
    if value is None and none_ok:
        return None
    # bool is an int subclass, but ``max_tokens=True`` is always a bug, never "1".
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        kind = "an int or None" if none_ok else "an int"
        raise ValueError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")
    return int(value)


def _float(name: str, value: object) -> float:
    """``value`` as a finite float; ints are fine (``temperature=0``), bools, NaN and inf not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return out


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def _stop_strings(value: object) -> list[str]:
    """Normalize ``stop`` to a list of non-empty strings."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"stop must be a str, a list of str or None, got {value!r}")
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise ValueError(f"stop must contain only strings, got {s!r} ({type(s).__name__})")
        # An empty stop string would match at every position and end every request at once.
        if s == "":
            raise ValueError("stop must not contain empty strings, got ''")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: no generated text can ever contain it
            raise ValueError(f"stop[{i}] must be valid Unicode text, got {s!r}") from None
    return list(items)


def _stop_token_ids(value: object) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of int or None, got {value!r}")
    if _plain_token_ids(value):
        return list(value)
    out = []
    for t in value:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
            raise ValueError(f"stop_token_ids must contain only ints >= 0, got {t!r}")
        out.append(int(t))
    return out


def _token_id(name: str, value: object) -> int:
    """A token id: an int >= 0, or its decimal string (OpenAI's JSON ``logit_bias`` keys)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must hold token ids (ints >= 0), got {value!r}")
    return int(value)


def _plain_token_ids(values) -> bool:
    """All plain ints >= 0: what the server sends. Checked with C-level loops, since a list may
    name the whole vocabulary and the per-item checks below are Python calls per id, on the thread
    that prepares requests, which the engine thread then waits on for the GIL (a whole-vocabulary
    request's preparation: benchmarks/bench_request_prep.py)."""
    return set(map(type, values)) <= {int} and (not values or min(values) >= 0)


def _logit_bias(value: object) -> dict[int, float] | None:
    """Token id -> bias, each bias clamped to [-100, 100] as vLLM's server does."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias or None, got {value!r:.80}")
    biases = list(value.values())
    if _plain_token_ids(value.keys()) and set(map(type, biases)) <= {float}:
        lo, hi = (min(biases), max(biases)) if biases else (0.0, 0.0)
        if math.isfinite(lo) and math.isfinite(hi) and not any(b != b for b in biases):  # b != b: NaN
            if -LOGIT_BIAS_LIMIT <= lo and hi <= LOGIT_BIAS_LIMIT:
                return dict(value)
            return {t: min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, b)) for t, b in value.items()}
    out = {}
    for tok, bias in value.items():
        bias = _float(f"logit_bias[{tok!r}]", bias)
        out[_token_id("logit_bias", tok)] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, bias))
    return out


def _allowed_token_ids(value: object) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not value:
        # An empty list would mask every token: nothing could ever be sampled.
        raise ValueError(f"allowed_token_ids must be a non-empty list of token ids or None, got {value!r:.80}")
    if _plain_token_ids(value):
        return list(value)
    return [_token_id("allowed_token_ids", t) for t in value]


def _bad_words(value: object) -> list[str] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in items):
        raise ValueError(f"bad_words must be a list of non-empty strings or None, got {value!r:.80}")
    return list(items)


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a language (vLLM's ``StructuredOutputsParams``). Exactly one of
    ``json``, ``regex``, ``choice``, ``grammar`` and ``json_object`` must be set.

    Attributes:
        json: A JSON schema (a dict, or its JSON text): the output is one JSON value valid for it.
        regex: The output matches this regular expression (the whole output).
        choice: The output is exactly one of these strings.
        grammar: An EBNF grammar in the backend's dialect (xgrammar's GBNF-like EBNF, rule ``root``).
        json_object: True: the output is any JSON object (OpenAI's ``response_format=json_object``).
        disable_any_whitespace: JSON without free whitespace between tokens (compact, and small
            models cannot loop on newlines). Applies to ``json`` and ``json_object``.
        whitespace_pattern: vLLM's regex for JSON whitespace; the xgrammar backend has no such
            option, so a request that sets it is refused (ValueError) rather than ignored.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, "
                             f"json_object; got {kinds or 'none'}")
        if not isinstance(self.json, (dict, str, type(None))):
            raise ValueError(f"structured_outputs.json must be a dict or a JSON string, got {self.json!r:.80}")
        for name in ("regex", "grammar", "whitespace_pattern"):
            if not isinstance(getattr(self, name), (str, type(None))):
                raise ValueError(f"structured_outputs.{name} must be a string, got {getattr(self, name)!r:.80}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r:.80}")
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be True or None, got {self.json_object!r}")
        _bool("structured_outputs.disable_any_whitespace", self.disable_any_whitespace)

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    """How to pick the tokens of one request (vLLM semantics).

    Attributes:
        n: Number of completions (samples) per prompt, in [1, 128]. The prompt is prefilled once
            and the samples share its KV blocks; each then runs as its own sequence. With a
            ``seed``, sample j draws from its own generator seeded ``seed + j`` (vLLM's rule).
        temperature: Logits are divided by it before sampling. Lower is more deterministic;
            below 1e-5 (e.g. 0) the request is greedy (argmax) and top_p/top_k/min_p are ignored.
        top_p: Nucleus sampling: keep the smallest set of most likely tokens whose cumulative
            probability reaches ``top_p``, in (0, 1]. 1 disables it.
        top_k: Keep only the ``top_k`` most likely tokens. 0 or -1 disables it.
        min_p: Drop tokens whose probability is below ``min_p`` times the most likely token's,
            in [0, 1]. 0 disables it.
        seed: Seed of this request's own random generator. The same seed, prompt and parameters
            give the same tokens whatever else is in the batch. None uses the engine's generator.
        stop: Strings that end generation when they appear in the output. The stop string itself
            is not returned unless ``include_stop_str_in_output``. Normalized to a list.
        stop_token_ids: Token ids that end generation (the token is kept in ``token_ids`` but,
            if it is a special token, not in the text). Normalized to a list.
        max_tokens: Maximum number of tokens to generate. None means "until the context is full"
            (the engine fills in ``max_model_len - prompt_len``).
        min_tokens: EOS and ``stop_token_ids`` are forbidden until this many tokens exist.
        ignore_eos: Keep generating after EOS (for benchmarks that need an exact length).
        logprobs: Return the log-probability of each sampled token plus this many top
            alternatives (0 = just the sampled token's), in [0, 20]. None returns none. Computed
            from the raw model logits, before temperature/top-k/top-p (vLLM's default).
        prompt_logprobs: Return, for every prompt token after the first, its log-probability
            given the tokens before it plus this many top alternatives, in [0, 20]. None (the
            default) computes nothing. Such a request runs its prefill through the PyTorch path
            and never takes prefix-cache hits: every prompt row must be computed (as in vLLM).
        skip_special_tokens: Leave special tokens out of the detokenized text.
        include_stop_str_in_output: Keep the matched stop string at the end of the text.
        output_kind: What each streamed output contains (see ``RequestOutputKind``).
        presence_penalty: Subtracted from the logit of every token already in the output, in
            [-2, 2]. Positive values push towards new tokens.
        frequency_penalty: Subtracted once per occurrence in the output, in [-2, 2].
        repetition_penalty: For tokens in the prompt or the output, positive logits are divided by
            it and negative ones multiplied (> 0; 1 disables it; above 1 discourages repeats).
        logit_bias: Token id -> value added to its logit (clamped to [-100, 100]).
        allowed_token_ids: Only these tokens may be sampled.
        bad_words: Words that may never be generated: the last token of a word is banned whenever
            the output ends with the tokens before it (each word tokenized with and without a
            leading space).
        structured_outputs: Constrain the output to a JSON schema, regex, choice or grammar
            (see ``StructuredOutputsParams``). Such requests get no speculative proposals.
        extra_args: Free-form arguments for custom logits processors (vLLM's field; ``vllm_xargs``
            in an HTTP request), a dict with string keys; each processor's ``validate_params``
            checks the keys it reads (engine/logits_processor.py). minserve itself reads none.

    Penalties, biases, bans and the grammar mask change what is sampled (greedy too); they are
    applied in vLLM's order (allowed ids, bad words, min_tokens and logit_bias, then the penalties,
    the grammar mask) before temperature, top-k and top-p. ``logprobs`` are still those of the raw
    model logits, before any of them.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    extra_args: dict[str, Any] | None = None
    # Token ids of each bad word (vLLM's name), filled by the engine from its tokenizer.
    _bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)
    # The logits controls in the form a step uses (engine/penalties.py PreparedControls), built once
    # by LLMEngine.prepare_params / add_request. An init field, so that dataclasses.replace copies
    # it (add_request then checks that the copy's values still match before trusting it).
    _prepared: object = field(default=None, repr=False, compare=False, kw_only=True)

    def __post_init__(self) -> None:
        self._check_sampling()
        self._check_lengths()
        self._check_logits_controls()
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _stop_token_ids(self.stop_token_ids)
        self.ignore_eos = _bool("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _bool("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = _bool(
            "include_stop_str_in_output", self.include_stop_str_in_output)
        self.output_kind = self._check_output_kind(self.output_kind)
        if self.extra_args is not None and not (isinstance(self.extra_args, dict)
                                                and all(isinstance(k, str) for k in self.extra_args)):
            raise ValueError(f"extra_args must be a dict with string keys or None, got {self.extra_args!r:.80}")

    def _check_sampling(self) -> None:
        self.n = _int("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        self.temperature = _float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        self.top_p = _float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or >= 1, got {self.top_k}")
        self.min_p = _float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        self.seed = _int("seed", self.seed, none_ok=True)
        # torch.Generator.manual_seed accepts exactly this range.
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be in [-2**63, 2**64 - 1] or None, got {self.seed}")

    def _check_lengths(self) -> None:
        self.max_tokens = _int("max_tokens", self.max_tokens, none_ok=True)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        self.min_tokens = _int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens}")
        self.logprobs = _int("logprobs", self.logprobs, none_ok=True)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] or None, "
                             f"got {self.logprobs}")
        self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs, none_ok=True)
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] or None, "
                             f"got {self.prompt_logprobs}")

    def _check_logits_controls(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        self.logit_bias = _logit_bias(self.logit_bias)
        self.allowed_token_ids = _allowed_token_ids(self.allowed_token_ids)
        self.bad_words = _bad_words(self.bad_words)
        if isinstance(self.structured_outputs, dict):  # e.g. straight from a JSON request body
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or None, "
                             f"got {type(self.structured_outputs).__name__}")

    @property
    def uses_structured_outputs(self) -> bool:
        """True when a grammar constrains the output: such a request gets no speculative
        proposals (the draft does not know the grammar, and the matcher only moves forward)."""
        return self.structured_outputs is not None

    @staticmethod
    def _check_output_kind(value: object) -> RequestOutputKind:
        # Accept the plain ints vLLM's enum values stand for (0/1/2), since IntEnum compares equal.
        if isinstance(value, RequestOutputKind):
            return value
        if not isinstance(value, bool) and isinstance(value, int) and value in (0, 1, 2):
            return RequestOutputKind(value)
        raise ValueError(f"output_kind must be a RequestOutputKind (CUMULATIVE=0, DELTA=1, "
                         f"FINAL_ONLY=2), got {value!r}")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def clone(self) -> SamplingParams:
        """A deep copy: the engine fills ``max_tokens`` without touching the caller's object."""
        return copy.deepcopy(self)
