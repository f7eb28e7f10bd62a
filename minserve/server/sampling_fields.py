"""The request fields beyond the basic sampling ones: which are refused, and how the rest become
SamplingParams keyword arguments (penalties, biases, bans, structured outputs) or prompt edits
(truncation).

Every field of the request schema (protocol.py) is handled in exactly one place: the basic ones in
serving.prepare, the chat-template ones in chat_template.py, the tool ones in tool_parsers/, the
response-side ones in responses.py, and the rest here. A field this server cannot honour is
refused with a 400 naming it (vLLM's wording where vLLM has one) instead of being dropped: a
silently ignored field is a wrong answer the client cannot see.
"""

from __future__ import annotations

from minserve.sampling_params import StructuredOutputsParams
from minserve.server.protocol import ApiError

# field -> why it is refused; refused when set to anything but its default (see _is_set).
UNSUPPORTED: dict[str, str] = {
    "use_beam_search": "beam search (use_beam_search) is not supported by this server",
    "length_penalty": "length_penalty only applies to beam search, which this server does not "
                      "support; leave it at 1.0",
    # vLLM's own answer to suffix (fill-in-the-middle) in serving_completion.
    "suffix": "suffix is not currently supported",
    "prompt_embeds": "prompt_embeds are not supported by this server; send the prompt as text or "
                     "token ids",
    "logits_processors": "The `logits_processors` argument is not supported by this server.",
    "mm_processor_kwargs": "mm_processor_kwargs is for multimodal models; this server's model "
                           "takes text only",
    "kv_transfer_params": "kv_transfer_params: disaggregated serving (KV transfer) is not "
                          "supported by this server",
    # vLLM refuses a per-request template unless started with --trust-request-chat-template,
    # a flag this server does not have (a template is code the server runs).
    "chat_template": "Chat template is passed with request, but --trust-request-chat-template is "
                     "not set. Refused request with untrusted chat template.",
    "spaces_between_special_tokens": "spaces_between_special_tokens=false is not supported by "
                                     "this server's detokenizer",
    "include_reasoning": "include_reasoning=false needs a reasoning parser; this server has none "
                         "(the whole output is content)",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported by this server",
    "return_token_ids": "return_token_ids is not supported by this server",
    "logprob_token_ids": "logprob_token_ids is not supported by this server; use logprobs",
    "repetition_detection": "repetition_detection is not supported by this server",
    "max_repetition_pattern_size": "repetition pattern detection is not supported by this server",
    "min_repetition_pattern_size": "repetition pattern detection is not supported by this server",
    "repetition_min_count": "repetition pattern detection is not supported by this server",
    "thinking_token_budget": "thinking_token_budget needs a reasoning model and parser; this "
                             "server has neither",
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported (the grammar backend "
                                 "has no whitespace option); use "
                                 "structured_outputs.disable_any_whitespace",
}

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


# vllm_xargs become SamplingParams.extra_args, which only custom logits processors read
# (``minserve serve --logits-processors``); a server without any refuses them rather than drop them.
NO_EXTRA_ARGS_READERS = "vllm_xargs: this server runs no extensions that would read extra arguments"


def check_fields(body, kind: str, reads_extra_args: bool = False) -> None:
    """Refuse what this server does not implement, and vLLM's invalid combinations.
    ``reads_extra_args``: the engine runs logits processors, which read ``vllm_xargs``."""
    fields = type(body).model_fields
    for name, message in UNSUPPORTED.items():
        if name in fields and _is_set(getattr(body, name), fields[name].default):
            raise ApiError(400, message, name)
    if not reads_extra_args and body.vllm_xargs:
        raise ApiError(400, NO_EXTRA_ARGS_READERS, "vllm_xargs")
    # vLLM's test is on the raw JSON: an empty {} passes, as does null.
    if body.stream_options is not None and body.stream_options.model_fields_set and not body.stream:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.",
                       "stream_options")
    if body.best_of is not None:
        if body.best_of < body.n:
            raise ApiError(400, f"best_of must be greater than or equal to n, got n={body.n} and "
                           f"best_of={body.best_of}.", "best_of")
        if body.best_of > body.n:
            raise ApiError(400, f"best_of > n is not supported by this server (got n={body.n}, "
                           f"best_of={body.best_of}): it returns every sample it draws", "best_of")
    if kind == "chat" and body.continue_final_message and body.add_generation_prompt:
        raise ApiError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` "
                       "to True.", "continue_final_message")
    if body.truncation_side is not None and body.truncate_prompt_tokens is None:
        raise ApiError(400, "truncation_side needs truncate_prompt_tokens", "truncation_side")


def _is_set(value, default) -> bool:
    """Set to something that asks for the feature: not the default, and (for fields whose default
    is None) not an explicit null or false, which ask for nothing."""
    return value != default and value is not None and not (default is None and value is False)


def sampling_kwargs(body, vocab_size: int, tool_schema: dict | None = None) -> dict:
    """SamplingParams keyword arguments for the penalty, bias, ban and structured-output fields;
    only those the request sets, so a plain request builds the same SamplingParams as before."""
    kw: dict = {}
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):  # None and 0.0 both mean "off" (vLLM's Optional default 0.0)
            kw[name] = getattr(body, name)
    if body.repetition_penalty is not None:
        kw["repetition_penalty"] = body.repetition_penalty
    if body.logit_bias:
        kw["logit_bias"] = _bias_tokens(body.logit_bias, vocab_size)
    if body.allowed_token_ids is not None:
        _check_ids("allowed_token_ids", body.allowed_token_ids, vocab_size)
        kw["allowed_token_ids"] = body.allowed_token_ids
    if body.bad_words:
        kw["bad_words"] = body.bad_words
    structured = structured_outputs_of(body, tool_schema)
    if structured is not None:
        kw["structured_outputs"] = structured
    if body.vllm_xargs:
        kw["extra_args"] = dict(body.vllm_xargs)
    return kw


def _bias_tokens(bias: dict[str, float], vocab_size: int) -> dict[int, float]:
    """Token id -> bias. ``map(int, ...)`` converts the keys in C (a whole-vocabulary bias is 49 k
    of them); a key it refuses, or one out of range, is then named by the per-key check."""
    try:
        ids = list(map(int, bias))
    except ValueError:
        ids = None
    if ids is None or (ids and not 0 <= min(ids) <= max(ids) < vocab_size):
        return {_bias_token(k, vocab_size): v for k, v in bias.items()}
    return dict(zip(ids, bias.values()))


def _bias_token(key: str, vocab_size: int) -> int:
    """OpenAI sends logit_bias keys as strings of token ids."""
    try:
        token = int(key)
    except ValueError:
        raise ApiError(400, f"logit_bias keys must be token ids (decimal strings), got {key!r}",
                       "logit_bias") from None
    if not 0 <= token < vocab_size:
        raise ApiError(400, f"token_id(s) [{token}] in logit_bias contain out-of-vocab token ids. "
                       f"Vocabulary size: {vocab_size}", "logit_bias")
    return token


def _check_ids(name: str, ids: list[int], vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(400, f"{name} contains out-of-vocab token ids {bad[:5]} (vocabulary size "
                       f"{vocab_size})", name)


def structured_outputs_of(body, tool_schema: dict | None = None) -> StructuredOutputsParams | None:
    """One StructuredOutputsParams from ``structured_outputs``, ``response_format``, vLLM's older
    ``guided_*`` fields and a forced tool call (its JSON schema), or None. As in vLLM,
    response_format's constraint replaces the one in structured_outputs."""
    spec = _requested_structure(body)
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        spec = {k: v for k, v in spec.items() if k in ("disable_any_whitespace", "whitespace_pattern")}
        spec.update(_response_format_constraint(fmt))
    if tool_schema is not None:
        if any(k in spec for k in CONSTRAINT_KINDS):
            raise ApiError(400, "You can only either use constraints for structured outputs or "
                           "tools, not both.", "tool_choice")
        spec["json"] = tool_schema
    if not spec:
        return None
    param = "response_format" if fmt is not None and fmt.type != "text" else "structured_outputs"
    try:
        return StructuredOutputsParams(**spec)
    except ValueError as e:
        raise ApiError(400, str(e), param) from None


def _requested_structure(body) -> dict:
    spec: dict = {}
    so = body.structured_outputs
    if so is not None:
        if so.structural_tag is not None:
            raise ApiError(400, "structured_outputs.structural_tag is not supported by this server",
                           "structured_outputs")
        spec = {k: v for k, v in so.model_dump(by_alias=True).items()
                if v is not None and not (k == "disable_any_whitespace" and v is False)}
        kinds = [k for k in ("json", "regex", "choice") if k in spec]
        if len(kinds) > 1:
            raise ApiError(400, "You can only use one kind of constraints for structured outputs "
                           "('json', 'regex' or 'choice').", "structured_outputs")
    for name, key in GUIDED_FIELDS.items():
        value = getattr(body, name, None)
        if value is not None:
            if any(k in spec for k in CONSTRAINT_KINDS):
                raise ApiError(400, f"{name} cannot be combined with another structured-output "
                               "constraint", name)
            spec[key] = value
    return spec


def _response_format_constraint(fmt) -> dict:
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.type == "structural_tag":
        raise ApiError(400, "response_format type 'structural_tag' is not supported by this server",
                       "response_format")
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise ApiError(400, "When response_format type is 'json_schema', the 'json_schema' field "
                       "(with its 'schema') must be provided.", "response_format")
    # strict=false is not honoured differently: the schema is always enforced (as in vLLM).
    return {"json": fmt.json_schema.json_schema}


def truncate_prompt(ids: list[int], body, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last k tokens (``truncation_side="right"``: the
    first k); -1 means the model's context length."""
    k = body.truncate_prompt_tokens
    if k is None:
        return ids
    if k == -1:
        k = max_model_len
    if k < 1:
        raise ApiError(400, f"truncate_prompt_tokens must be >= 1 or -1, got {k}",
                       "truncate_prompt_tokens")
    if len(ids) <= k:
        return ids
    return ids[:k] if body.truncation_side == "right" else ids[-k:]
