"""What ``LLMEngine.add_request`` accepts, checked before a request can join a batch.

A value that is wrong for one request must be refused here, with a ValueError naming it: once the
request sits in a batch, anything that raises inside the step (hashing its cache key, banning its
stop tokens) happens in the middle of other requests' work. The engine contains such failures to
the request that caused them (llm_engine.py), but refusing at the door is cheaper and clearer.
"""

from __future__ import annotations

from minserve.engine.penalties import bad_words_token_ids
from minserve.sampling_params import SamplingParams


def check_text(name: str, text: str) -> None:
    """Python strings may hold lone UTF-16 surrogates (JSON's ``"\\ud800"``), which no UTF-8
    codec, tokenizer or hash input accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} must be valid Unicode text: it holds a lone surrogate "
                         f"{text[e.start]!r} at character {e.start}") from None


def check_cache_salt(cache_salt) -> None:
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}")
    check_text("cache_salt", cache_salt)


def check_params(params: SamplingParams, vocab_size: int, eos_token_ids: list[int]) -> None:
    """Token ids in range, and ``min_tokens`` must leave the sampler something to pick."""
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids must be in [0, {vocab_size}), got {bad[:5]}")
    if params.min_tokens > 0:
        banned = set(params.stop_token_ids)
        if not params.ignore_eos:
            banned.update(eos_token_ids)
        if len(banned) >= vocab_size:
            raise ValueError(f"stop_token_ids (with EOS unless ignore_eos) cover all {vocab_size} "
                             f"tokens, so min_tokens={params.min_tokens} leaves nothing to sample")


def prepare_logits_controls(params: SamplingParams, vocab_size: int, tokenizer, grammar) -> None:
    """Token ids of ``logit_bias`` / ``allowed_token_ids`` / ``bad_words`` in the vocabulary, bad
    words tokenized (vLLM's ``_bad_words_token_ids``), the structured-output spec compiled (cached
    by ``grammar``, a GrammarBackend): an invalid one is refused here, naming its field."""
    for name in ("logit_bias", "allowed_token_ids"):
        bad = [t for t in getattr(params, name) or () if t >= vocab_size]
        if bad:
            raise ValueError(f"{name} must hold token ids in [0, {vocab_size}), got {bad[:5]}")
    if params.bad_words:
        for w in params.bad_words:
            check_text("bad_words", w)
        params._bad_words_token_ids = bad_words_token_ids(params.bad_words, tokenizer)
        bad = [t for ids in params._bad_words_token_ids for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"bad_words tokenize to ids outside the model's vocabulary: {bad[:5]}")
    if params.structured_outputs is not None:
        grammar.compile(params.structured_outputs)


def prompt_ids(prompt, tokenizer, vocab_size: int) -> tuple[str | None, list[int]]:
    """A string, a list of token ids, or vLLM's TextPrompt / TokensPrompt dict -> (text, ids)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = list(prompt["prompt_token_ids"])
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("prompt dict must have 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must be a non-empty string")
        check_text("prompt", prompt)
        return prompt, tokenizer(prompt).input_ids
    if isinstance(prompt, (list, tuple)) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids must be in [0, {vocab_size}), got {bad[:5]}")
        return None, list(prompt)
    raise ValueError(f"prompt must be a non-empty string or a non-empty list of token ids, "
                     f"got {prompt!r:.80}")
