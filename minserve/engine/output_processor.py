"""After a step: append sampled tokens, detokenize, check stop conditions, build outputs.

Stop conditions, in the order vLLM applies them: an EOS token (unless ``ignore_eos``) or one of
``stop_token_ids`` (both only once ``min_tokens`` are out), a ``stop`` string appearing in the
text (the text is cut before it unless ``include_stop_str_in_output``), ``max_tokens`` reached, or
the model's context ``max_model_len`` full.
"""

from __future__ import annotations

import dataclasses
import time

from minserve.engine.parallel_sampling import ParentRequest
from minserve.engine.request import Request, RequestStatus
from minserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from minserve.sampling_params import RequestOutputKind

DETOKENIZE_CONTEXT_TOKENS = 6  # tokens of left context decoded with each new token


def direct_decoder(tokenizer):
    """A function ``(ids, skip_special_tokens) -> str`` equal to ``tokenizer.decode``, which every
    token calls twice (and once per logprob entry). For a transformers tokenizer whose ``decode`` is
    the library's own and does no space clean-up, that call only forwards a list of ids to the Rust
    tokenizer: calling it directly skips the Python layers in between (conversions, keyword
    handling). Anything else, or another transformers layout, keeps ``tokenizer.decode``."""
    def through_decode(ids, skip):
        return tokenizer.decode(ids, skip_special_tokens=skip)
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return through_decode
    cls = type(tokenizer)
    if not (isinstance(tokenizer, TokenizersBackend) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is TokenizersBackend._decode and tokenizer.clean_up_tokenization_spaces is False):
        return through_decode
    rust = tokenizer.backend_tokenizer

    def direct(ids, skip):
        return rust.decode(ids, skip_special_tokens=skip)
    return direct


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int, clock_offset_s: float):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.clock_offset_s = clock_offset_s  # time.time() - time.perf_counter() at engine start
        self._decoder_of, self._decoder = None, None  # see _decode

    def append_token(self, req: Request, token_id: int, logprobs, rank,
                      now: float | None = None) -> RequestStatus | None:
        """Record one sampled token; return the finished status if it ends the request. Tokens
        that one step produced together (a verify step) share that step's time ``now``."""
        req.output_token_ids.append(token_id)
        req.timeline.token_s.append(time.perf_counter() if now is None else now)
        if logprobs is not None:
            # Built once per token here, not rebuilt for the whole output at every step.
            req.output_logprobs.append(self._logprob_dict(logprobs, rank))
            req.cumulative_logprob += logprobs[0][1]
        p = req.params
        n_out = len(req.output_token_ids)
        prev_len = len(req.output_text)
        self._detokenize(req, final=False)
        # Structured outputs: the matcher moves on final tokens only (this one is); the request
        # ends when the grammar has terminated (it accepted EOS), even under ignore_eos.
        state = req.structured
        grammar_done = state is not None and state.request_id == req.request_id and state.advance(req.output_token_ids)
        if n_out >= p.min_tokens:
            if token_id in p.stop_token_ids:
                req.stop_reason = token_id
                return self._finish(req, RequestStatus.FINISHED_STOPPED)
            if not p.ignore_eos and token_id in req.eos_token_ids:
                return self._finish(req, RequestStatus.FINISHED_STOPPED)
            if p.stop and self._cut_at_stop_string(req, prev_len):
                return RequestStatus.FINISHED_STOPPED
        if grammar_done:
            return self._finish(req, RequestStatus.FINISHED_STOPPED)
        if n_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return self._finish(req, RequestStatus.FINISHED_LENGTH)
        return None

    def _finish(self, req: Request, status: RequestStatus) -> RequestStatus:
        self._detokenize(req, final=True)  # release any held-back partial character
        return status

    def _detokenize(self, req: Request, final: bool) -> None:
        """Extend ``output_text`` by decoding a short window, not the whole output every token
        (that would cost O(n^2) over a long answer). The window starts a few tokens back so the
        tokenizer sees the context that decides spacing; text that ends in a replacement
        character is held back until the next token completes the UTF-8 sequence."""
        ids, skip = req.output_token_ids, req.params.skip_special_tokens
        start, read = req.detok_prefix_offset, req.detok_read_offset
        before = self._decode(ids[start:read], skip)
        after = self._decode(ids[start:], skip)
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            req.output_text += after[len(before):]
            req.detok_prefix_offset = max(0, len(ids) - DETOKENIZE_CONTEXT_TOKENS)
            req.detok_read_offset = len(ids)

    @staticmethod
    def _cut_at_stop_string(req: Request, prev_len: int) -> bool:
        text, p = req.output_text, req.params
        for stop in p.stop:
            # Only the new text (plus an overlap for a stop string split across tokens) can hold it.
            at = text.find(stop, max(0, prev_len - len(stop) + 1))
            if at >= 0:
                req.output_text = text[:at + len(stop)] if p.include_stop_str_in_output else text[:at]
                req.stop_reason = stop
                return True
        return False

    def make_output(self, req: Request) -> RequestOutput | None:
        """The RequestOutput for this step, honouring the request's output kind."""
        if req.params.output_kind is RequestOutputKind.FINAL_ONLY and not req.finished:
            return None
        prompt_logprobs = self._prompt_logprobs(req)
        if req.params.output_kind is RequestOutputKind.DELTA and req.sent_tokens_len:
            prompt_logprobs = None  # as vLLM: a stream carries the prompt logprobs once, first
        completion = self.completion_output(req)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion],
                             req.finished, self.metrics(req), prompt_logprobs=prompt_logprobs,
                             num_cached_tokens=req.num_cached_tokens, error=req.error)

    def completion_output(self, req: Request) -> CompletionOutput:
        """One sequence's CompletionOutput (``index``: its sample index), everything so far or,
        for DELTA, what is new since the last one (then marked as sent)."""
        text, token_ids = req.output_text, req.output_token_ids
        asked = req.params.logprobs is not None
        logprobs = req.output_logprobs if asked else None
        if req.params.output_kind is RequestOutputKind.DELTA:
            # output_text never ends in a partial character (the detokenizer holds those back),
            # so every delta is printable as it is.
            text, token_ids = text[req.sent_text_len:], token_ids[req.sent_tokens_len:]
            logprobs = logprobs[req.sent_tokens_len:] if asked else None
            req.sent_text_len, req.sent_tokens_len = len(req.output_text), len(req.output_token_ids)
        return CompletionOutput(req.sample_index, text, list(token_ids),
                                req.cumulative_logprob if asked else None,
                                list(logprobs) if asked else None, req.finish_reason, req.stop_reason)

    def parent_output(self, parent: ParentRequest, every_sample: bool = False) -> RequestOutput | None:
        """The step's RequestOutput of a request with ``n > 1`` (vLLM's shapes): FINAL_ONLY, one
        output with all n samples by index once all finished; streaming, the samples that got
        tokens this step (``parent.changed``), each known by its ``index``. ``finished`` is True
        only when every sample is. ``every_sample``: all of them (a failed request's last one)."""
        changed, parent.changed = parent.changed, []
        kind = parent.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not parent.finished:
            return None
        samples = parent.samples if every_sample or kind is RequestOutputKind.FINAL_ONLY else changed
        first = parent.samples[0]  # the sample that computed the prompt
        prompt_logprobs = self._prompt_logprobs(first)
        if kind is RequestOutputKind.DELTA and parent.num_outputs_sent:
            prompt_logprobs = None
        parent.num_outputs_sent += 1
        completions = [self.completion_output(s) for s in sorted(samples, key=lambda s: s.sample_index)]
        return RequestOutput(parent.request_id, first.prompt, first.prompt_token_ids, completions,
                             parent.finished, self.parent_metrics(parent), prompt_logprobs=prompt_logprobs,
                             num_cached_tokens=first.num_cached_tokens, error=parent.error)

    def _prompt_logprobs(self, req: Request) -> list | None:
        """vLLM's ``RequestOutput.prompt_logprobs``: None first, then a dict per prompt token.
        The runner records raw entries; each is made into a dict once, the first time it is sent
        (CUMULATIVE outputs send the list every step)."""
        if req.params.prompt_logprobs is None:
            return None
        entries = req.prompt_logprobs
        raw = len(entries)
        while raw and isinstance(entries[raw - 1], tuple):
            raw -= 1
        entries[raw:] = [self._logprob_dict(top, rank) for top, rank in entries[raw:]]
        return [None] + entries

    def error_output(self, req: Request) -> RequestOutput:
        """The last output of a request that failed: what it produced so far, finish_reason
        "error" and the reason; built without detokenizing again (that may be what failed).
        For a sample of an ``n > 1`` request: its parent's, with every sample."""
        try:
            if req.parent is not None:
                return self.parent_output(req.parent, every_sample=True)
            return self.make_output(req)
        except Exception:
            head = req if req.parent is None else req.parent.samples[0]  # the request's id, prompt
            error = req.error if req.parent is None else req.parent.error
            completion = CompletionOutput(req.sample_index, "", [], None, None, req.finish_reason, None)
            return RequestOutput(head.request_id, head.prompt, head.prompt_token_ids, [completion], True,
                                 self.metrics(head), num_cached_tokens=head.num_cached_tokens, error=error)

    def _logprob_dict(self, entries: list[tuple[int, float]], sampled_rank: int | None) -> dict[int, Logprob]:
        """vLLM's layout: the sampled token first, then the top-N by rank (it may repeat)."""
        sampled, lp = entries[0]
        d: dict[int, Logprob] = {sampled: Logprob(lp, sampled_rank, self._decode([sampled], False))}
        for rank, (tok, tok_lp) in enumerate(entries[1:], start=1):
            d.setdefault(tok, Logprob(tok_lp, rank, self._decode([tok], False)))
        return d

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        """``self.tokenizer.decode(ids, skip_special_tokens=...)``, through :func:`direct_decoder`
        (looked up again when the tokenizer is replaced)."""
        if self._decoder_of is not self.tokenizer:
            self._decoder_of, self._decoder = self.tokenizer, direct_decoder(self.tokenizer)
        return self._decoder(ids, skip_special_tokens)

    def parent_metrics(self, parent: ParentRequest) -> RequestMetrics:
        """A request's metrics over its samples: its arrival and admission (sample 0's), its
        first token and last token over all, finished when the last one is; generated tokens
        and preemptions summed."""
        each = [self.metrics(s) for s in parent.samples]
        first_tokens = [m.first_token_time for m in each if m.first_token_time is not None]
        last_tokens = [m.last_token_time for m in each if m.last_token_time is not None]
        return dataclasses.replace(
            each[0], first_token_time=min(first_tokens, default=None),
            last_token_time=max(last_tokens, default=None),
            finished_time=max((m.finished_time for m in each if m.finished_time is not None), default=None)
            if parent.finished else None,
            num_generation_tokens=sum(m.num_generation_tokens for m in each),
            num_preemptions=sum(m.num_preemptions for m in each))

    def metrics(self, req: Request) -> RequestMetrics:
        t = req.timeline
        wall = (lambda s: None if s is None else s + self.clock_offset_s)
        return RequestMetrics(
            arrival_time=wall(t.arrival_s), last_token_time=wall(t.token_s[-1] if t.token_s else None),
            first_scheduled_time=wall(t.first_scheduled_s), first_token_time=wall(t.first_token_s),
            time_in_queue=None if t.first_scheduled_s is None else t.first_scheduled_s - t.arrival_s,
            finished_time=wall(t.finished_s), num_generation_tokens=len(req.output_token_ids),
            num_preemptions=req.num_preemptions)
