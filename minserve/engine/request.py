"""A request's state machine and its timeline.

States: WAITING -> RUNNING -> finished (STOPPED, LENGTH, ABORTED, ERROR); RUNNING -> PREEMPTED (its KV
blocks were taken back; it waits to recompute) -> RUNNING again. A request is described by one
growing token list, prompt then output, and ``num_computed_tokens``, how many of those already
have K/V in the cache. Prefill, chunked prefill, decode and recompute after preemption are all the
same thing: compute the tokens from ``num_computed_tokens`` to the end, then sample.

Timestamps come from ``time.perf_counter()`` (monotonic, fine-grained); ``RequestOutput`` turns
them into wall-clock seconds at the API boundary.
"""

from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from minserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minserve.engine.parallel_sampling import ParentRequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


@dataclass
class RequestTimeline:
    """Every event a lab plots, in perf_counter seconds."""
    arrival_s: float
    scheduled_s: list[float] = field(default_factory=list)   # each (re)admission to the running set
    preempted_s: list[float] = field(default_factory=list)
    token_s: list[float] = field(default_factory=list)       # when each output token was sampled
    finished_s: float | None = None

    @property
    def first_scheduled_s(self) -> float | None:
        return self.scheduled_s[0] if self.scheduled_s else None

    @property
    def first_token_s(self) -> float | None:
        return self.token_s[0] if self.token_s else None


class _Finishable:
    """The status-derived views shared by live requests and their records."""

    __slots__ = ()  # keeps RequestRecord's slots effective
    status: RequestStatus

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.finished else None


@dataclass
class Request(_Finishable):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float
    max_tokens: int                     # resolved: params.max_tokens capped by max_model_len
    eos_token_ids: list[int]
    generator: torch.Generator | None = None
    cache_salt: str | None = None
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)  # per token: {token_id: Logprob}, if asked
    # If params.prompt_logprobs: one entry per prompt token after the first, filled chunk by chunk
    # from the model runner's output (the engine appends them), made into {token_id: Logprob} by
    # the output processor.
    prompt_logprobs: list = field(default_factory=list)
    cumulative_logprob: float = 0.0
    output_text: str = ""
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    sent_text_len: int = 0                # for DELTA outputs: how much text was already returned
    detok_prefix_offset: int = 0          # incremental detokenization window (output token indices)
    detok_read_offset: int = 0
    sent_tokens_len: int = 0
    # Prefix caching: (hash, key) of each full block of known tokens, the digest of the extra keys,
    # how many of the current table's blocks are published, and the hit tokens at first admission.
    block_hashes: list = field(default_factory=list)
    extra_keys: bytes | None = None
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0
    error: str | None = None             # why it ended with status "error"
    # Speculative tokens proposed for the next step (not yet part of the output: verification
    # decides which become final), and where the current prefill ends: computing tokens below
    # ``prefill_end`` is prefill work (a prompt, or a recompute after preemption), above it decode.
    spec_token_ids: list[int] = field(default_factory=list)
    prefill_end: int = 0
    num_spec_proposed: int = 0            # proposals verified for it, and how many were accepted
    num_spec_accepted: int = 0
    # Parallel sampling (n > 1; engine/parallel_sampling.py): this sequence is sample
    # ``sample_index`` of ``parent``. Sample 0 computes the prompt; ``unforked_samples`` are the
    # others, forked off it (sharing its prompt's KV blocks) in the step its prompt is done.
    sample_index: int = 0
    parent: ParentRequest | None = None
    unforked_samples: list[Request] = field(default_factory=list)
    # Structured outputs: the request's grammar matcher (minserve/structured), made on its first
    # sampling step and advanced on its final tokens; None for unconstrained requests.
    structured: object | None = None
    timeline: RequestTimeline = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.timeline is None:
            self.timeline = RequestTimeline(self.arrival_s)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the joined list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def is_prefill(self) -> bool:
        """Still has more than one uncomputed token (prompt, or tokens to recompute)."""
        return self.num_tokens - self.num_computed_tokens > 1


@dataclass(slots=True)
class RequestRecord(_Finishable):
    """What a finished request leaves behind for ``requests_frame()``: counts and times only.

    A live request holds its token lists, prefix-cache keys and RNG state (~30 KiB for a few
    hundred tokens); a server keeping thousands of those grows without end. The record keeps the
    same attribute names the frame reads, token times as 8-byte floats.
    """

    request_id: str
    status: RequestStatus
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    error: str | None
    timeline: RequestTimeline
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0

    @classmethod
    def of(cls, req: Request) -> "RequestRecord":
        tl = req.timeline
        times = RequestTimeline(tl.arrival_s, tl.scheduled_s, tl.preempted_s, array("d", tl.token_s),
                                tl.finished_s)
        return cls(req.request_id, req.status, req.num_prompt_tokens, req.num_output_tokens,
                   req.num_cached_tokens, req.num_preemptions, req.error, times,
                   req.num_spec_proposed, req.num_spec_accepted)
