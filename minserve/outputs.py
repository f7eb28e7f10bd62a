"""What a request returns, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``.

Times in :class:`RequestMetrics` are wall-clock seconds (``time.time()``) like vLLM's, converted at
this boundary from the engine's monotonic clock; the derived latencies are in seconds.

The derived latencies use the definitions of :mod:`minserve.metrics.latency` (vLLM's), the same
as the ``vllm:*`` histograms and the requests frame:
- queue time ``time_in_queue`` = first scheduled - arrival;
- TTFT = first token - arrival (includes queueing and the whole prefill);
- TPOT = (last token - first token) / (output tokens - 1), None below two tokens;
- E2E = finished (or last token, while running) - arrival.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minserve.metrics import latency


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    last_token_time: float | None
    first_scheduled_time: float | None
    first_token_time: float | None
    time_in_queue: float | None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft_s(self) -> float | None:
        return latency.ttft_s(self.arrival_time, self.first_token_time)

    @property
    def e2e_s(self) -> float | None:
        end = self.finished_time if self.finished_time is not None else self.last_token_time
        return latency.e2e_s(self.arrival_time, end)

    @property
    def tpot_s(self) -> float | None:
        """None until there are two tokens (a single token has no "per output token" time)."""
        return latency.tpot_s(self.first_token_time, self.last_token_time,
                              self.num_generation_tokens)


@dataclass
class CompletionOutput:
    index: int                          # which sample, 0..n-1 (SamplingParams.n)
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop token id or string that ended it (None for EOS)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # With n > 1 (vLLM's shapes): FINAL_ONLY, all n samples by index; streaming (DELTA,
    # CUMULATIVE), the samples that got tokens in this step. ``finished``: all n are.
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # If SamplingParams.prompt_logprobs was set: None for the first prompt token (nothing comes
    # before it), then per prompt token {token_id: Logprob}, the token itself first (vLLM's layout).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict = field(default_factory=dict)
    # minserve's addition: why the request failed when its finish_reason is "error" (one bad
    # request fails alone; the others in its step go on). vLLM raises instead.
    error: str | None = None
