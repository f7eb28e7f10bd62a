"""From engine outputs to OpenAI responses: choices, logprobs, usage and stream chunks.

One HTTP request may be several engine requests (a completions ``prompt`` list: one per prompt,
as vLLM does), and each engine request may carry ``n`` samples (``CompletionOutput.index``).
Choices are numbered ``prompt_index * n + sample index``; usage sums prompt tokens over the
prompts (once each, however many samples share them) and completion tokens over every choice.

Formats follow vLLM's OpenAI server, which follows OpenAI's:

- completions ``logprobs``: ``tokens``, ``token_logprobs``, ``text_offset`` and ``top_logprobs``,
  where each ``top_logprobs`` entry holds the chosen token and the ``logprobs`` most likely ones
  (so up to ``logprobs + 1`` entries, as OpenAI documents);
- ``echo``: the prompt text before the completion and, with ``logprobs``, the prompt tokens'
  logprobs before the completion's; the first prompt token has no logprob (nothing predicts it),
  so its ``token_logprobs`` and ``top_logprobs`` are null;
- ``prompt_logprobs`` (vLLM's field): per prompt token ``null`` first, then
  ``{token_id: {"logprob", "rank", "decoded_token"}}``, in each completions choice and at the top
  of a chat response;
- a logprob of ``-inf`` (a masked token) is sent as -9999.0: JSON has no infinity.
"""

from __future__ import annotations

import json
from itertools import islice

from minserve.outputs import CompletionOutput, Logprob, RequestOutput
from minserve.server.protocol import error_body

LOGPROB_FLOOR = -9999.0  # OpenAI's stand-in for -inf


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    # cached_tokens: prompt tokens served from the prefix cache (OpenAI's field), always present
    # (0 with prefix caching off). The cache is salted per tenant, so these are always the
    # caller's own tenant's hits.
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def _top(d: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The top-k alternatives of one position, best first (chat's ``top_logprobs``)."""
    ranked = [(t, lp) for t, lp in d.items() if lp.rank is not None and 1 <= lp.rank <= k]
    return sorted(ranked, key=lambda e: e[1].rank)


def completion_logprobs(token_ids: list[int], dicts: list[dict[int, Logprob] | None], k: int,
                        offset: int, tokenizer) -> dict:
    """OpenAI's completions ``logprobs`` object. ``dicts``: one per token, the token itself first
    then the ranked alternatives (the engine's layout), or None where the token has no logprob
    (the first prompt token under echo); ``offset``: the text offset of the first token."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tok, d in zip(token_ids, dicts):
        if d is None:
            text, lp, top = tokenizer.decode([tok]), None, None
        else:
            text, lp = d[tok].decoded_token or "", _lp(d[tok].logprob)
            # The chosen token, then the k best: the dict's first k + 1 entries.
            top = {(e.decoded_token or ""): _lp(e.logprob) for e in islice(d.values(), k + 1)}
        tokens.append(text)
        token_lps.append(lp)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(c: CompletionOutput, k: int) -> dict:
    def entry(lp: Logprob) -> dict:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": _lp(lp.logprob), "bytes": list(text.encode())}

    content = []
    for tok, d in zip(c.token_ids, c.logprobs or []):
        content.append({**entry(d[tok]), "top_logprobs": [entry(e) for _, e in _top(d, k)]})
    return {"content": content}


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None] | None) -> list | None:
    """vLLM's ``prompt_logprobs`` as JSON (token ids become string keys, as in vLLM's)."""
    if entries is None:
        return None
    return [None if d is None else
            {str(t): {"logprob": _lp(e.logprob), "rank": e.rank, "decoded_token": e.decoded_token}
             for t, e in d.items()} for d in entries]


def _sorted_samples(out: RequestOutput) -> list[CompletionOutput]:
    return sorted(out.outputs, key=lambda c: c.index)


def _echoed(p, pi: int, out: RequestOutput, c: CompletionOutput, prompt_lps) -> tuple:
    """(text, token ids, logprob dicts) of one completions choice, the prompt first under echo."""
    if not p.echo:
        return c.text, c.token_ids, c.logprobs or []
    prompt_lps = prompt_lps or [None] * len(out.prompt_token_ids)
    if p.echo_only:  # max_tokens=0: the prompt alone (the one token sampled is not shown)
        return p.prompt_texts[pi], out.prompt_token_ids, prompt_lps
    return (p.prompt_texts[pi] + c.text, [*out.prompt_token_ids, *c.token_ids],
            [*prompt_lps, *(c.logprobs or [])])


def _completion_choice(p, index: int, pi: int, out: RequestOutput, c: CompletionOutput,
                       tokenizer) -> dict:
    text, ids, dicts = _echoed(p, pi, out, c, out.prompt_logprobs)
    lps = completion_logprobs(ids, dicts, p.top_logprobs, 0, tokenizer) if p.top_logprobs is not None else None
    return {"index": index, "text": text, "logprobs": lps, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason, "prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs)}


def _chat_choice(p, index: int, c: CompletionOutput) -> dict:
    # chat_reply: tool calls and echo (tool_parsers/reply.py); it may change the finish reason.
    message, finish = (p.chat_reply.message(c.text, c.finish_reason) if p.chat_reply
                       else ({"role": "assistant", "content": c.text}, c.finish_reason))
    return {"index": index, "message": message,
            "logprobs": chat_logprobs(c, p.top_logprobs) if p.top_logprobs is not None else None,
            "finish_reason": finish, "stop_reason": c.stop_reason}


def full_response(p, outs: list[RequestOutput], tokenizer) -> dict:
    """The whole answer, from the final output of each prompt (in prompt order)."""
    choices, completion_tokens = [], 0
    for pi, out in enumerate(outs):
        for c in _sorted_samples(out):
            index = pi * p.n + c.index
            choices.append(_chat_choice(p, index, c) if p.kind == "chat"
                           else _completion_choice(p, index, pi, out, c, tokenizer))
            completion_tokens += len(c.token_ids)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    body = {"id": p.request_id, "object": "chat.completion" if p.kind == "chat" else "text_completion",
            "created": p.created, "model": p.model, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, sum(o.num_cached_tokens for o in outs))}
    if p.kind == "chat":
        body["prompt_logprobs"] = prompt_logprobs_json(outs[0].prompt_logprobs)
    return body


class StreamFormatter:
    """Turns DELTA outputs into OpenAI stream chunks (``data: {...}`` lines).

    ``delta(prompt_index, output)`` takes the outputs of every prompt of the request, in any
    interleaving; each sample in an output becomes one chunk for its choice."""

    def __init__(self, p, tokenizer=None):
        self.p, self.tokenizer = p, tokenizer
        num_choices = len(p.prompts) * p.n
        self.prompt_tokens = [len(ids) for ids in p.prompts]
        self.cached_tokens = [0] * len(p.prompts)
        self.completion_tokens = [0] * num_choices
        self.text_offset = [0] * num_choices
        self.echoed = [False] * num_choices
        self.prompt_lps: list = [None] * len(p.prompts)  # kept for every sample's echo
        self.opened = False  # the chat role chunks were sent
        # chat: one ReplyStream per choice (tool calls held back until parsed, echo first)
        reply = getattr(p, "chat_reply", None)
        self.replies = [reply.streamer() for _ in range(num_choices)] if reply else None
        self.object = "chat.completion.chunk" if p.kind == "chat" else "text_completion"

    def _chunk(self, choices: list, **extra) -> str:
        return sse({"id": self.p.request_id, "object": self.object, "created": self.p.created,
                    "model": self.p.model, "choices": choices, **extra})

    def _usage_of(self, pi: int, index: int) -> dict:
        return usage(self.prompt_tokens[pi], self.completion_tokens[index], self.cached_tokens[pi])

    def start(self) -> list[str]:
        # OpenAI opens a chat stream with the role of each choice, before any content. Sent with
        # the first output, as vLLM does: benchmark clients (vLLM's bench serve among them) start
        # TTFT at the first chunk with choices, so a role chunk sent at once would make TTFT ~0.
        if self.p.kind != "chat" or self.opened:
            return []
        self.opened = True
        chunks = []
        for index in range(len(self.completion_tokens)):
            extra = {"usage": self._usage_of(0, index)} if self.p.continuous_usage else {}
            chunks.append(self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}], **extra))
        return chunks

    def delta(self, out: RequestOutput, prompt_index: int = 0) -> list[str]:
        self.cached_tokens[prompt_index] = out.num_cached_tokens  # fixed when first scheduled
        if out.prompt_logprobs is not None:
            self.prompt_lps[prompt_index] = out.prompt_logprobs
        chunks = self.start()
        for c in _sorted_samples(out):
            chunks += self._sample(prompt_index, out, c)
        return chunks

    def _sample(self, pi: int, out: RequestOutput, c: CompletionOutput) -> list[str]:
        index = pi * self.p.n + c.index
        self.completion_tokens[index] += len(c.token_ids)
        want_lp = self.p.top_logprobs is not None and bool(c.token_ids)
        echo_now = self.p.echo and not self.echoed[index]
        if not (c.text or c.finish_reason or want_lp or echo_now):
            return []  # e.g. half of a multi-byte character, held back by the engine
        finish = c.finish_reason
        if self.p.kind == "chat":
            delta, finish = (self.replies[index].delta(c.text, finish) if self.replies
                             else ({"content": c.text} if c.text else {}, finish))
            choice = {"index": index, "delta": delta,
                      "logprobs": chat_logprobs(c, self.p.top_logprobs) if want_lp else None}
        else:
            choice = self._completion_delta(pi, index, out, c, echo_now)
        choice.update(finish_reason=finish, stop_reason=c.stop_reason)
        extra = {"usage": self._usage_of(pi, index)} if self.p.continuous_usage else {}
        return [self._chunk([choice], **extra)]

    def _completion_delta(self, pi: int, index: int, out: RequestOutput, c: CompletionOutput,
                          echo_now: bool) -> dict:
        if echo_now:
            self.echoed[index] = True
            text, ids, dicts = _echoed(self.p, pi, out, c, self.prompt_lps[pi])
        else:
            text, ids, dicts = c.text, c.token_ids, c.logprobs or []
        lps = None
        if self.p.top_logprobs is not None and ids:
            lps = completion_logprobs(ids, dicts, self.p.top_logprobs, self.text_offset[index],
                                      self.tokenizer)
        self.text_offset[index] += len(text)
        return {"index": index, "text": text, "logprobs": lps}

    def end(self) -> list[str]:
        tail = []
        if self.p.include_usage:
            tail.append(self._chunk([], usage=usage(sum(self.prompt_tokens), sum(self.completion_tokens),
                                                    sum(self.cached_tokens))))
        return tail + [sse("[DONE]")]

    @staticmethod
    def error(status: int, message: str, code: str | None = None) -> str:
        return sse(error_body(status, message, code=code))
