"""What ``LLMEngine.add_request`` accepts, checked before a request can join a batch.

A value that is wrong for one request must be refused here, with a ValueError naming it: once the
request sits in a batch, anything that raises inside the step (hashing its cache key, banning its
stop tokens) happens in the middle of other requests' work. The engine contains such failures to
the request that caused them (llm_engine.py), but refusing at the door is cheaper and clearer.

Constraints that contradict each other are refused here when the contradiction is certain from
the values alone (``allowed_token_ids`` all banned until ``min_tokens``; a ``choice`` too short for
``min_tokens``); the rest can only show mid-run, where the engine fails that request alone.
"""

from __future__ import annotations

from minserve.sampling_params import SamplingParams


def check_text(name: str, text: str) -> None:
    """Python strings may hold lone UTF-16 surrogates (JSON's ``"\\ud800"``), which no UTF-8
    codec, tokenizer or hash input accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} must be valid Unicode text: it holds a lone surrogate "
                         f"{text[e.start]!r} at character {e.start}") from None


def out_of_vocabulary(token_ids, vocab_size: int) -> list[int]:
    """The ids of ``token_ids`` outside ``[0, vocab_size)``, in order. The one rule for a token id
    a request names (prompt, stop_token_ids): such an id would only fail later, inside a batched
    step, taking the other requests of that step down with it. The server (server/serving.py)
    asks the same question to answer in its own words."""
    return [t for t in token_ids if not 0 <= t < vocab_size]


def check_cache_salt(cache_salt) -> None:
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}")
    check_text("cache_salt", cache_salt)


def check_priority(priority) -> None:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer (lower is served first under "
                         f"scheduling_policy='priority'), got {priority!r}")


def check_prompt_fits(n: int, config, max_model_len: int) -> None:
    """A prompt of ``n`` tokens can be scheduled under ``config`` (an EngineConfig) and leaves room
    for at least one output token within ``max_model_len``."""
    if not config.enable_chunked_prefill and n > config.max_num_batched_tokens:
        # It could never be scheduled: without chunking a prompt must fit in one step.
        raise ValueError(f"prompt is {n} tokens; with enable_chunked_prefill=False a prompt must "
                         f"fit in one step of max_num_batched_tokens={config.max_num_batched_tokens}")
    if n >= max_model_len:
        raise ValueError(f"prompt is {n} tokens; it must be shorter than max_model_len="
                         f"{max_model_len} to leave room for at least one output token")


def check_params(params: SamplingParams, vocab_size: int, eos_token_ids: list[int]) -> None:
    """Token ids in range, and ``min_tokens`` must leave the sampler something to pick."""
    bad = out_of_vocabulary(params.stop_token_ids, vocab_size)
    if bad:
        raise ValueError(f"stop_token_ids must be in [0, {vocab_size}), got {bad[:5]}")
    banned = set()
    if params.min_tokens > 0:
        banned.update(params.stop_token_ids)
        if not params.ignore_eos:
            banned.update(eos_token_ids)
        if len(banned) >= vocab_size:
            raise ValueError(f"stop_token_ids (with EOS unless ignore_eos) cover all {vocab_size} "
                             f"tokens, so min_tokens={params.min_tokens} leaves nothing to sample")
    check_allowed_token_ids(params, banned)
    check_choice_length(params)


def check_allowed_token_ids(params: SamplingParams, banned: set[int]) -> None:
    """Refuse ``allowed_token_ids`` that leave nothing to sample at the first output token: all of
    them banned until ``min_tokens`` (``banned``: stop ids and EOS, empty without min_tokens) or
    one-token bad words (known once the bad words are tokenized: prepare_logits_controls calls
    this again then). Certain, so refused: the first step would find the row empty."""
    if params.allowed_token_ids is None:
        return
    words = {w[0] for w in params._bad_words_token_ids or () if len(w) == 1}
    if set(params.allowed_token_ids) - banned - words:
        return
    why = [f"min_tokens={params.min_tokens} bans stop_token_ids and EOS (unless ignore_eos) until "
           "then" if banned else "", "one-token bad_words are never sampled" if words else ""]
    raise ValueError(f"allowed_token_ids leaves no token that may be sampled at output token 0: "
                     f"{' and '.join(w for w in why if w)}, and every allowed id is one of those")


def check_choice_length(params: SamplingParams) -> None:
    """A structured ``choice`` ends after at most as many tokens as its longest choice has UTF-8
    bytes (a byte-level BPE token is at least one byte), and then allows only EOS: with
    ``min_tokens`` above that length (EOS banned until then, unless ignore_eos) the request is
    sure to find nothing to sample. Equal is possible (one token per byte), so it passes."""
    spec = params.structured_outputs
    if spec is None or spec.choice is None or params.min_tokens == 0 or params.ignore_eos:
        return
    longest = max(len(c.encode("utf-8", "surrogatepass")) for c in spec.choice)
    if params.min_tokens > longest:
        raise ValueError(f"min_tokens={params.min_tokens} is more than structured_outputs.choice allows: "
                         f"its longest choice is {longest} UTF-8 bytes, so the output ends (only EOS "
                         f"may follow) within {longest} tokens, and EOS is banned until min_tokens")


def prepare_logits_controls(params: SamplingParams, vocab_size: int, tokenizer, grammar,
                            eos_token_ids: list[int] = (), device="cpu", owner: object = None) -> None:
    """Token ids of ``logit_bias`` / ``allowed_token_ids`` / ``bad_words`` in the vocabulary, bad
    words tokenized (vLLM's ``_bad_words_token_ids``), the structured-output spec compiled (cached
    by ``grammar``, a GrammarBackend): an invalid one is refused here, naming its field. Then the
    tensors a step uses are built (penalties.prepare_controls) and kept on ``params``."""
    # Here, not at the top: the server's request checks import this module, and `minserve serve
    # --help` should not load PyTorch (penalties.py builds tensors).
    from minserve.engine.penalties import bad_words_token_ids, prepare_controls
    for name in ("logit_bias", "allowed_token_ids"):
        bad = [t for t in getattr(params, name) or () if t >= vocab_size]
        if bad:
            raise ValueError(f"{name} must hold token ids in [0, {vocab_size}), got {bad[:5]}")
    words = None
    if params.bad_words:
        for w in params.bad_words:
            check_text("bad_words", w)
        words = bad_words_token_ids(params.bad_words, tokenizer)
        bad = [t for ids in words for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"bad_words tokenize to ids outside the model's vocabulary: {bad[:5]}")
    compiled = None
    if params.structured_outputs is not None:
        compiled = (grammar, grammar.compile(params.structured_outputs))
    params._bad_words_token_ids = words
    if words:  # check_params could not see the one-token bad words yet
        banned = set()
        if params.min_tokens > 0:
            banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        check_allowed_token_ids(params, banned)
    prepare_controls(params, vocab_size, device, owner, compiled)


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
        bad = out_of_vocabulary(prompt, vocab_size)
        if bad:
            raise ValueError(f"prompt_token_ids must be in [0, {vocab_size}), got {bad[:5]}")
        return None, list(prompt)
    raise ValueError(f"prompt must be a non-empty string or a non-empty list of token ids, "
                     f"got {prompt!r:.80}")
