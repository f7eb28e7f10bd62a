"""From an OpenAI request body to engine inputs (the way back, outputs to responses: responses.py).

Everything that can be wrong with a request is found here, before it is admitted or queued: the
cheap limits first (limits.py: prompt characters, stop strings, valid Unicode everywhere), then the
prompt is tokenized on the HTTP side (admission needs its length, and a prompt that does not fit
the context must be a 400 now, not a failure later on the engine thread), and the SamplingParams
are built here so their ValueErrors (which name the field and the range) become 400s.
:func:`prepare` is blocking work (tokenizing, rendering chat templates): app.py runs it off the
event loop.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field

from minserve.engine.inputs import check_cache_salt, out_of_vocabulary
from minserve.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams
from minserve.server.chat_template import chat_prompt_ids, echo_prefix
from minserve.server.limits import RequestLimits, check_lists, check_sizes, check_strings
from minserve.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest, value_error
from minserve.server.sampling_fields import check_fields, sampling_kwargs, truncate_prompt
from minserve.server.tool_parsers.plan import ToolConfig, plan_tools
from minserve.server.tool_parsers.reply import ChatReply

# A batch is one engine request per prompt; admission still counts each (app.py). vLLM's
# default bound (VLLM_MAX_COMPLETION_PROMPTS) is far higher; ours keeps one body's tokenizing short.
MAX_PROMPTS_PER_REQUEST = 256


@dataclass
class Prepared:
    """A validated request, ready for admission and the engine: one engine request per prompt
    (a completions request may send a list of them), each with ``params.n`` samples."""

    kind: str                          # "completion" | "chat"
    request_id: str
    prompt_ids: list[int]              # the first (often the only) prompt
    params: SamplingParams             # the first prompt's; see batch_params
    model: str
    top_logprobs: int | None           # how many alternatives to show per token, None: no logprobs
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    prompts: list[list[int]] = field(default_factory=list)       # every prompt, in order
    batch_params: list[SamplingParams] = field(default_factory=list)  # per prompt (max_tokens differ)
    prompt_texts: list[str] = field(default_factory=list)       # what echo prepends, per prompt
    echo: bool = False
    echo_only: bool = False            # echo with max_tokens=0: the prompt, no completion text
    continuous_usage: bool = False     # usage on every stream chunk (vLLM's continuous_usage_stats)
    chat_reply: ChatReply | None = None  # chat: tool calls and echo in the message (tool_parsers/)
    # The engine's key for this request, made here and never shown: see engine_request_ids.
    engine_key: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        self.prompts = self.prompts or [self.prompt_ids]
        self.batch_params = self.batch_params or [self.params]

    @property
    def n(self) -> int:
        return self.params.n

    def engine_request_ids(self) -> list[str]:
        """One engine id per prompt, made by the server: the response id (which the client may
        choose, vLLM's ``request_id`` field) plus a random key, suffixed per prompt for a batch.
        The client's id is only a label on the response: two requests, of one tenant or of two,
        may send the same one, and neither can abort, observe or be refused because of the other
        (the engine keys requests by id, so a client-chosen key let tenant B abort tenant A's
        stream, and its "already in use" told B which ids were in flight)."""
        base = f"{self.request_id}@{self.engine_key}"
        if len(self.prompts) == 1:
            return [base]
        return [f"{base}-{i}" for i in range(len(self.prompts))]


def prepare(body, kind: str, engine, model_name: str, limits: RequestLimits | None = None,
            tools: ToolConfig | None = None) -> Prepared:
    """Validate ``body`` against the engine's limits; raises ApiError / ValueError (-> 400)."""
    limits = limits or RequestLimits()
    check_sizes(body, kind, limits, engine.max_model_len)  # before tokenizing
    check_lists(body, limits, engine.model_config.vocab_size)
    check_strings(body)  # before any message quotes a value
    if body.model is not None and body.model != model_name:
        raise ApiError(404, f"The model `{body.model}` does not exist; this server serves "
                       f"`{model_name}` (see /v1/models)", "model", "model_not_found")
    check_fields(body, kind, bool(getattr(engine, "logits_processor_classes", ())))  # sampling_fields.py
    echo = kind != "chat" and body.echo
    plan = plan_tools(body, tools) if kind == "chat" else None
    if kind == "chat":
        prompts, texts = [chat_prompt_ids(body, engine.tokenizer, plan)], [""]
        param = "messages"
        requested, mt_param = _chat_max_tokens(body)
        top = _chat_top_logprobs(body)
    else:
        prompts, texts = completion_prompts(body, engine)
        param = "prompt"
        requested, mt_param, top = body.max_tokens, "max_tokens", body.logprobs
    prompts = [truncate_prompt(ids, body, engine.max_model_len) for ids in prompts]
    echo_only = echo and requested == 0  # vLLM: return the prompt alone, sample one token unseen
    _check_stop_token_ids(body.stop_token_ids, engine.model_config.vocab_size)
    max_tokens = [resolve_max_tokens(1 if echo_only else requested, len(ids), engine.max_model_len,
                                     param, mt_param,
                                     explicit=kind == "chat" or "max_tokens" in body.model_fields_set)
                  for ids in prompts]
    try:
        check_cache_salt(body.cache_salt)  # the engine's rule (engine/inputs.py), in the API's words
    except ValueError:
        raise ApiError(400, "cache_salt must be a non-empty string or omitted", "cache_salt") from None
    params = SamplingParams(
        n=body.n, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
        min_p=body.min_p or 0.0, seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids,
        max_tokens=max_tokens[0], min_tokens=body.min_tokens, ignore_eos=body.ignore_eos, logprobs=top,
        prompt_logprobs=_prompt_logprobs(body, echo, top),
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        # Streams get only what is new each step; a plain response needs only the final result.
        output_kind=RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY,
        **sampling_kwargs(body, engine.model_config.vocab_size, plan.schema if plan else None))
    try:
        # The engine's own checks (e.g. min_tokens with every token a stop token) as a 400 now, and
        # its per-request work (bad words tokenized, grammar compiled, the allowed-ids mask and the
        # bias tensors built) here on the prepare pool: on the engine thread it stalled every
        # stream (200 k bad words froze them for 10 s).
        engine.prepare_params(params)
    except ValueError as e:
        raise value_error(e) from None
    # Only max_tokens differs between the prompts of a batch (each fills its own context room).
    batch_params = [params if m == params.max_tokens else dataclasses.replace(params, max_tokens=m)
                    for m in max_tokens]
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    opts = body.stream_options
    include_usage = bool(opts and opts.include_usage)
    request_id = f"{prefix}-{body.request_id or uuid.uuid4().hex}"  # vLLM: the client may name it
    return Prepared(kind, request_id, prompts[0], params, model_name, top,
                    include_usage, prompts=prompts, batch_params=batch_params, prompt_texts=texts,
                    echo=echo, echo_only=echo_only,
                    continuous_usage=include_usage and opts.continuous_usage_stats,
                    chat_reply=ChatReply(plan, echo_prefix(body)) if kind == "chat" else None)


def _prompt_logprobs(body, echo: bool, top: int | None) -> int | None:
    """vLLM's rules: prompt_logprobs only without streaming; echo with logprobs asks for the
    prompt's logprobs at the same depth (the echoed prompt tokens need them)."""
    asked = body.prompt_logprobs
    if asked is not None and body.stream:
        raise ApiError(400, "`prompt_logprobs` are not available when `stream=True`.",
                       "prompt_logprobs")
    if asked is None and echo:
        return top
    return asked


def completion_prompts(body: CompletionRequest, engine) -> tuple[list[list[int]], list[str]]:
    """The token ids and the text (what echo prepends) of every prompt of a completions request:
    a string, a list of token ids, or a list of either (a batch, one engine request each)."""
    prompt = body.prompt
    batch = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
    if len(batch) > MAX_PROMPTS_PER_REQUEST:
        raise ApiError(400, f"prompt: a list of {len(batch)} prompts; at most "
                       f"{MAX_PROMPTS_PER_REQUEST} per request", "prompt")
    ids = [_one_prompt_ids(p, engine, "prompt" if len(batch) == 1 else f"prompt.{i}",
                           body.add_special_tokens) for i, p in enumerate(batch)]
    texts = [p if isinstance(p, str) else engine.tokenizer.decode(i) if body.echo else ""
             for p, i in zip(batch, ids)]
    return ids, texts


def _one_prompt_ids(prompt, engine, param: str, add_special_tokens: bool = True) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, f"{param} must be a non-empty string", param)
        return list(engine.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)
    ids = list(prompt)
    vocab = engine.model_config.vocab_size
    if not ids or out_of_vocabulary(ids, vocab):
        raise ApiError(400, f"{param}: prompt token ids must be a non-empty list of ints in "
                       f"[0, {vocab})", param)
    return ids


def _chat_max_tokens(body: ChatCompletionRequest) -> tuple[int | None, str]:
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


def _chat_top_logprobs(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}",
                       "top_logprobs")
    if not body.logprobs:
        if body.top_logprobs:
            raise ApiError(400, "when using `top_logprobs`, `logprobs` must be set to true.",
                           "top_logprobs")  # vLLM's wording
        return None
    return body.top_logprobs or 0


def _check_stop_token_ids(ids: list[int] | None, vocab: int) -> None:
    # The engine's rule (engine/inputs.py out_of_vocabulary), checked before the body is admitted.
    if ids and out_of_vocabulary(ids, vocab):
        raise ApiError(400, f"stop_token_ids must be ints in [0, {vocab}), got {ids[:5]}",
                       "stop_token_ids")


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, prompt_param: str,
                       param: str, explicit: bool) -> int:
    """Check the prompt fits and the output bound fits after it (vLLM's 400s); an absent bound
    means "fill the context", and OpenAI's implicit completions default of 16 is capped."""
    room = max_model_len - prompt_len
    if room < 1:
        raise ApiError(400, f"{prompt_param} is {prompt_len} tokens; this model's context is "
                       f"max_model_len={max_model_len}, so it must be at most {max_model_len - 1} "
                       "tokens to leave room for one output token", prompt_param)
    if requested is None:
        return room
    if not explicit:
        return min(requested, room)
    if requested < 1 or requested > room:
        raise ApiError(400, f"{param} must be in [1, {room}] for this {prompt_len}-token prompt "
                       f"(max_model_len={max_model_len}), got {requested}", param)
    return requested
