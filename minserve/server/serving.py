"""From an OpenAI request body to engine inputs, and from engine outputs to OpenAI responses.

Everything that can be wrong with a request is found here, before it is admitted or queued: the
cheap limits first (limits.py: prompt characters, stop strings, valid Unicode everywhere), then the
prompt is tokenized on the HTTP side (admission needs its length, and a prompt that does not fit
the context must be a 400 now, not a failure later on the engine thread), and the SamplingParams
are built here so their ValueErrors (which name the field and the range) become 400s.
:func:`prepare` is blocking work (tokenizing, rendering chat templates): app.py runs it off the
event loop.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from minserve.engine.inputs import check_params
from minserve.outputs import CompletionOutput, Logprob, RequestOutput
from minserve.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams
from minserve.server.limits import RequestLimits, check_sizes, check_strings
from minserve.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest, error_body

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class Prepared:
    """A validated request, ready for admission and the engine."""

    kind: str                          # "completion" | "chat"
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    model: str
    top_logprobs: int | None           # how many alternatives to show per token, None: no logprobs
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))


def prepare(body, kind: str, engine, model_name: str, limits: RequestLimits | None = None) -> Prepared:
    """Validate ``body`` against the engine's limits; raises ApiError / ValueError (-> 400)."""
    check_sizes(body, kind, limits or RequestLimits(), engine.max_model_len)  # before tokenizing
    check_strings(body)  # before any message quotes a value
    if body.model is not None and body.model != model_name:
        raise ApiError(404, f"The model `{body.model}` does not exist; this server serves "
                       f"`{model_name}` (see /v1/models)", "model", "model_not_found")
    if kind == "chat":
        ids, param = chat_prompt_ids(body, engine.tokenizer), "messages"
        requested, mt_param = _chat_max_tokens(body)
        top = _chat_top_logprobs(body)
    else:
        if body.echo:
            raise ApiError(400, "echo is not supported by this server; send echo=false", "echo")
        ids, param = completion_prompt_ids(body, engine), "prompt"
        requested, mt_param, top = body.max_tokens, "max_tokens", body.logprobs
    _check_stop_token_ids(body.stop_token_ids, engine.model_config.vocab_size)
    max_tokens = resolve_max_tokens(requested, len(ids), engine.max_model_len, param, mt_param,
                                    explicit=kind == "chat" or "max_tokens" in body.model_fields_set)
    if body.cache_salt is not None and not body.cache_salt:
        raise ApiError(400, "cache_salt must be a non-empty string or omitted", "cache_salt")
    params = SamplingParams(
        n=body.n, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
        min_p=body.min_p or 0.0, seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids,
        max_tokens=max_tokens, min_tokens=body.min_tokens, ignore_eos=body.ignore_eos, logprobs=top,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        # Streams get only what is new each step; a plain response needs only the final result.
        output_kind=RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY)
    try:  # the engine's own checks (e.g. min_tokens with every token a stop token), as a 400 now
        check_params(params, engine.model_config.vocab_size, engine.eos_token_ids)
    except ValueError as e:
        first = str(e).split(" ", 1)[0]
        raise ApiError(400, str(e), first if first.isidentifier() else None) from None
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    usage = bool(body.stream_options and body.stream_options.include_usage)
    return Prepared(kind, f"{prefix}-{uuid.uuid4().hex}", ids, params, model_name, top, usage)


def completion_prompt_ids(body: CompletionRequest, engine) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ApiError(400, f"prompt: this server takes one prompt per request, got a list of "
                           f"{len(prompt)}; send them as separate requests", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt must be a non-empty string", "prompt")
        ids = list(engine.tokenizer(prompt).input_ids)
    else:
        ids = list(prompt)
        vocab = engine.model_config.vocab_size
        if not ids or any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"prompt token ids must be a non-empty list of ints in [0, {vocab})",
                           "prompt")
    return ids


def chat_prompt_ids(body: ChatCompletionRequest, tokenizer) -> list[int]:
    if not body.messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    for i, m in enumerate(body.messages):
        if m.role not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {m.role!r}",
                           f"messages.{i}.role")
    conversation = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        out = tokenizer.apply_chat_template(conversation, add_generation_prompt=body.add_generation_prompt,
                                            tokenize=True, return_dict=True)
    except Exception as e:  # a template that rejects this conversation (e.g. role order)
        raise ApiError(400, f"messages could not be rendered with the chat template: {e}",
                       "messages") from None
    ids = list(out["input_ids"])
    if not ids:
        raise ApiError(400, "messages rendered to an empty prompt", "messages")
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
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        return None
    return body.top_logprobs or 0


def _check_stop_token_ids(ids: list[int] | None, vocab: int) -> None:
    # An out-of-vocabulary id would only fail later, inside a batched step, taking the other
    # requests of that step down with it.
    if ids and any(not 0 <= t < vocab for t in ids):
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


# ---- responses ---------------------------------------------------------------------------------

def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    # cached_tokens: prompt tokens served from the prefix cache (OpenAI's field). The cache is
    # salted per tenant, so these are always the caller's own tenant's hits.
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _top(d: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The top-k alternatives of one position, best first (the sampled token is listed only if
    it is among them, as in OpenAI's responses)."""
    ranked = [(t, lp) for t, lp in d.items() if lp.rank is not None and 1 <= lp.rank <= k]
    return sorted(ranked, key=lambda e: e[1].rank)


def completion_logprobs(c: CompletionOutput, k: int, offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for tok, d in zip(c.token_ids, c.logprobs or []):
        lp = d[tok]
        text = lp.decoded_token or ""
        tokens.append(text)
        token_lps.append(lp.logprob)
        tops.append({(e.decoded_token or ""): e.logprob for _, e in _top(d, k)} if k else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(c: CompletionOutput, k: int) -> dict:
    def entry(lp: Logprob) -> dict:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    content = []
    for tok, d in zip(c.token_ids, c.logprobs or []):
        content.append({**entry(d[tok]), "top_logprobs": [entry(e) for _, e in _top(d, k)]})
    return {"content": content}


def full_response(p: Prepared, out: RequestOutput) -> dict:
    c = out.outputs[0]
    if p.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": c.text},
                  "logprobs": chat_logprobs(c, p.top_logprobs) if p.top_logprobs is not None else None,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": c.text, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason,
                  "logprobs": (completion_logprobs(c, p.top_logprobs, 0)
                               if p.top_logprobs is not None else None)}
        obj = "text_completion"
    return {"id": p.request_id, "object": obj, "created": p.created, "model": p.model,
            "choices": [choice],
            "usage": usage(len(p.prompt_ids), len(c.token_ids), out.num_cached_tokens)}


class StreamFormatter:
    """Turns DELTA outputs into OpenAI stream chunks (``data: {...}`` lines)."""

    def __init__(self, p: Prepared):
        self.p = p
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.text_offset = 0
        self.opened = False  # the chat role chunk was sent
        self.object = "chat.completion.chunk" if p.kind == "chat" else "text_completion"

    def _chunk(self, choices: list, **extra) -> str:
        return sse({"id": self.p.request_id, "object": self.object, "created": self.p.created,
                    "model": self.p.model, "choices": choices, **extra})

    def start(self) -> list[str]:
        # OpenAI opens a chat stream with the role, before any content. Sent with the first
        # output, as vLLM does: benchmark clients (vLLM's bench serve among them) start TTFT at
        # the first chunk with choices, so a role chunk sent at once would make TTFT read ~0.
        if self.p.kind != "chat" or self.opened:
            return []
        self.opened = True
        return [self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])]

    def delta(self, out: RequestOutput) -> list[str]:
        return self.start() + self._delta(out)

    def _delta(self, out: RequestOutput) -> list[str]:
        c = out.outputs[0]
        self.completion_tokens += len(c.token_ids)
        self.cached_tokens = out.num_cached_tokens  # fixed when the request was first scheduled
        want_lp = self.p.top_logprobs is not None and c.token_ids
        if not (c.text or c.finish_reason or want_lp):
            return []  # e.g. half of a multi-byte character, held back by the engine
        if self.p.kind == "chat":
            choice = {"index": 0, "delta": {"content": c.text} if c.text else {},
                      "logprobs": chat_logprobs(c, self.p.top_logprobs) if want_lp else None}
        else:
            choice = {"index": 0, "text": c.text,
                      "logprobs": (completion_logprobs(c, self.p.top_logprobs, self.text_offset)
                                   if want_lp else None)}
            self.text_offset += len(c.text)
        choice.update(finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        return [self._chunk([choice])]

    def end(self) -> list[str]:
        tail = []
        if self.p.include_usage:
            tail.append(self._chunk([], usage=usage(len(self.p.prompt_ids), self.completion_tokens,
                                                    self.cached_tokens)))
        return tail + [sse("[DONE]")]

    @staticmethod
    def error(status: int, message: str, code: str | None = None) -> str:
        return sse(error_body(status, message, code=code))
