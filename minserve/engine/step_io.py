"""The step contract: what the scheduler asks for, and what the model runner gives back.

One engine step is ``schedule() -> SchedulerOutput -> ModelRunner.execute() -> ModelRunnerOutput ->
Scheduler.update_from_output()`` (then the engine's output processor appends the accepted tokens and
``Scheduler.settle()`` publishes their blocks), vLLM v1's shape. The records are plain data so a fake runner can
stand in for the model (tests/test_scheduler_fuzz.py drives the real scheduler and KV manager
through thousands of random steps that way).

Per request, a step computes ``num_new_tokens`` tokens on top of ``context_len`` cached ones:
- a prefill chunk: prompt tokens (or a recompute after preemption), sampling only if it ends them;
- a decode: the one token sampled last step;
- a verify step: that token plus ``spec_token_ids``, k proposed tokens. Logits of all k + 1 rows
  come back; the runner keeps the proposals that the model confirms and one token of its own
  after them, so a request gets between 1 and k + 1 tokens, and the K/V written for the proposals
  it rejected is rolled back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minserve.engine.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int     # tokens computed for it this step, proposals included
    context_len: int        # tokens already in its KV cache before this step
    spec_token_ids: list[int] = field(default_factory=list)  # proposals verified in this step
    needs_sampling: bool = False  # reaches the end of its known tokens, so tokens are sampled
    is_prefill: bool = False
    # Parallel sampling (engine/parallel_sampling.py): the request's other samples, forked off it
    # in this step (its prompt ends here), each drawing its first token from this request's last
    # logits row. The first ``num_seated_forks`` got a seat and a block table sharing its prompt
    # blocks; ``block_copies`` are (source, destination) KV blocks the runner copies after the
    # forward pass (the partly filled last prompt block, once per seated fork).
    forks: list[Request] = field(default_factory=list)
    num_seated_forks: int = 0
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Fixed at scheduling time: after the step the request has grown by the sampled tokens.
        req, end = self.request, self.context_len + self.num_new_tokens
        self.needs_sampling = end == req.num_tokens + len(self.spec_token_ids)
        self.is_prefill = self.context_len < req.prefill_end

    @property
    def num_logits_rows(self) -> int:
        """Rows whose logits are needed: the last token's, and one per proposal."""
        return 1 + len(self.spec_token_ids) if self.needs_sampling else 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    prefix_cache_queries: int = 0   # tokens of admitted requests looked up in the prefix cache
    prefix_cache_hits: int = 0      # of those, tokens found cached (prefill work skipped)
    # Waiting requests that could not even be looked at (e.g. their prefix-cache key raised):
    # taken out of the queue with the reason, for the engine to fail them alone.
    failed: list[tuple[Request, str]] = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if s.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        """Decode and verify tokens (the last sampled token plus its proposals)."""
        return sum(s.num_new_tokens for s in self.scheduled if not s.is_prefill)

    @property
    def num_spec_tokens(self) -> int:
        return sum(len(s.spec_token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SampledToken:
    token_id: int
    logprobs: list[tuple[int, float]] | None   # [(sampled, lp), top-N...] when asked
    rank: int | None


@dataclass
class ModelRunnerOutput:
    # Per request that sampled: its accepted tokens in order (1 for a decode or the end of a
    # prefill; 1..k+1 for a verify step: the confirmed proposals, then the model's own token).
    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)
    # Per request whose computation failed: its own constraints left nothing to sample (the
    # runner found it in the step), or the step raised and the engine reran it request by request.
    errors: dict[str, str] = field(default_factory=dict)
    # Of ``errors``, the requests that failed because of what they asked for (contradictory
    # constraints), not because of the engine: a server answers them 400, not 500.
    client_errors: set[str] = field(default_factory=set)
    # Per request asking for prompt logprobs whose prompt rows ran in this step: the entries of
    # those rows, in prompt order ((top list, rank) per token, SampledToken's layout), for the
    # engine to append to ``Request.prompt_logprobs``.
    prompt_logprobs: dict[str, list] = field(default_factory=dict)


@dataclass
class AcceptedTokens:
    """One request's tokens from a step, as :meth:`Scheduler.update_from_output` accepted them
    (1 for a decode or the end of a prefill; 1..k+1 after verification), with the samples forked
    off it in this step. The engine's output processor appends them and records here, through
    :meth:`keep`, how many it kept (a stop may cut a verify step's list short) and the finished
    status if one of them ended the request; :meth:`Scheduler.settle` acts on that."""
    request: Request
    tokens: list[SampledToken]
    forks: list["AcceptedTokens"] = field(default_factory=list)
    num_seated_forks: int = 0          # the first forks got a seat (ScheduledRequest's count)
    scheduled_s: float | None = None   # when the parent was first scheduled (the forks' too)
    num_kept: int = 0
    status: object = None              # RequestStatus once finished
    error: str | None = None           # appending failed: the request fails, nothing is settled

    def keep(self, num_kept: int, status) -> None:
        self.num_kept, self.status = num_kept, status


@dataclass
class StepUpdate:
    """What :meth:`Scheduler.update_from_output` and :meth:`Scheduler.settle` did with a step's
    results."""
    # Requests that computed tokens and sampled some, in step order (update_from_output).
    accepted: list[AcceptedTokens] = field(default_factory=list)
    # Requests that received tokens, with how many were appended (settle).
    appended: list[tuple[Request, int]] = field(default_factory=list)
    finished: list[tuple[Request, object]] = field(default_factory=list)  # (request, RequestStatus)
    failed: list[tuple[Request, str]] = field(default_factory=list)       # (request, why)
    num_accepted_spec_tokens: int = 0
    num_rejected_spec_tokens: int = 0
    verified: list[tuple[int, int]] = field(default_factory=list)  # (proposals, accepted) per request
