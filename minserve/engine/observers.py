"""Step observers: see every scheduled batch, every KV block event and every sampled token.

An experiment that wants to watch the engine without changing it subclasses :class:`StepObserver`,
overrides what it needs, and registers it::

    class Watch(StepObserver):
        def on_schedule(self, batch):
            print(batch.step, batch.num_prefill_tokens, batch.num_decode_tokens)

    llm.llm_engine.add_step_observer(Watch())

What it sees, in order, for one ``LLMEngine.step()`` that runs the model:

1. :meth:`StepObserver.on_kv_event` for each block change the scheduler makes while it builds the
   batch (``allocate``: new blocks and reused ones, i.e. prefix-cache hits or a fork's shared
   blocks; ``evict``: a cached block's contents dropped so the block can be reused; ``free``:
   blocks a request let go of: finished, preempted, aborted or rolled back);
2. :meth:`StepObserver.on_schedule` with the :class:`ScheduledBatch` (request ids, tokens per
   request, prefill or decode, proposals verified, who was preempted);
3. :meth:`StepObserver.on_logits` for requests the observer listed in ``capture_logits`` (opt-in
   per request id): that request's rows of the model's raw fp32 logits, a copy (one row, or k + 1
   for a verify step), before any logits processor or control;
4. the ``free`` events of the requests that finished, then :meth:`StepObserver.on_step_end` with
   the :class:`StepResult`: the tokens each request kept this step and the requests that finished.

Unused, it costs nothing: with no observer the engine builds none of these records (it checks
one attribute per step and per block operation), and no logits are copied.
:class:`LogitsRecorder` is a ready observer that keeps a bounded number of captured rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ScheduledRequestInfo:
    request_id: str
    num_new_tokens: int          # tokens computed for it this step (proposals included)
    context_len: int             # tokens already in its KV cache
    is_prefill: bool             # a prompt chunk (or a recompute), else a decode or verify step
    num_spec_tokens: int = 0     # proposals verified in this step


@dataclass(frozen=True)
class ScheduledBatch:
    step: int                    # the step's number (StepStats.step)
    requests: tuple[ScheduledRequestInfo, ...]
    preempted: tuple[str, ...]   # requests preempted while this batch was built
    num_prefill_tokens: int      # prompt (and recompute) tokens of the step
    num_decode_tokens: int       # decode and verify tokens (the last sampled token plus proposals)


@dataclass(frozen=True)
class KVEvent:
    kind: str                    # "allocate", "evict" or "free"
    request_id: str | None       # None for "evict" (the block's former content had no owner left)
    block_ids: tuple[int, ...]   # allocate: fresh blocks; evict: the evicted one; free: released ones
    reused_block_ids: tuple[int, ...] = ()  # allocate: prefix-cache hits or a fork's shared blocks


@dataclass(frozen=True)
class StepResult:
    step: int
    tokens: dict[str, list[int]]  # per request: the tokens it kept this step, in order
    finished: tuple[str, ...]     # requests that finished (any reason) in this step


class StepObserver:
    """Override the methods you need; ``capture_logits``: request ids whose logits to receive."""

    capture_logits: set[str] | frozenset = frozenset()

    def on_schedule(self, batch: ScheduledBatch) -> None:
        pass

    def on_kv_event(self, event: KVEvent) -> None:
        pass

    def on_logits(self, step: int, request_id: str, logits: torch.Tensor) -> None:
        pass

    def on_step_end(self, result: StepResult) -> None:
        pass


class LogitsRecorder(StepObserver):
    """Keeps the raw logits rows of the listed requests, at most ``max_rows`` per request (later
    rows are counted in ``dropped``, not kept): ``rows[request_id]`` is a list of [vocab] fp32."""

    def __init__(self, request_ids, max_rows: int = 64):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.capture_logits = set(request_ids)
        self.max_rows = max_rows
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.dropped: dict[str, int] = {}

    def on_logits(self, step: int, request_id: str, logits: torch.Tensor) -> None:
        kept = self.rows.setdefault(request_id, [])
        room = self.max_rows - len(kept)
        kept += list(logits[:room])
        if logits.shape[0] > room:
            self.dropped[request_id] = self.dropped.get(request_id, 0) + logits.shape[0] - max(room, 0)


@dataclass
class StepObservers:
    """The engine's registered observers, and the records built for them (only when some exist)."""

    observers: list[StepObserver] = field(default_factory=list)

    def kv_event(self, kind: str, request_id: str | None, blocks, reused=()) -> None:
        event = KVEvent(kind, request_id, tuple(blocks), tuple(reused))
        for o in self.observers:
            o.on_kv_event(event)

    def scheduled(self, step: int, sched) -> None:
        batch = ScheduledBatch(step, tuple(ScheduledRequestInfo(
            s.request.request_id, s.num_new_tokens, s.context_len, s.is_prefill, len(s.spec_token_ids))
            for s in sched.scheduled), tuple(r.request_id for r in sched.preempted),
            sched.num_prefill_tokens, sched.num_decode_tokens)
        for o in self.observers:
            o.on_schedule(batch)

    def logits(self, step: int, reqs: list, logits: torch.Tensor) -> None:
        """The runner's tap: rows of ``logits`` (one per entry of ``reqs``) of wanted requests."""
        for o in self.observers:
            wanted = o.capture_logits
            if not wanted:
                continue
            rows: dict[str, list[int]] = {}
            for i, r in enumerate(reqs):
                if r.request_id in wanted:
                    rows.setdefault(r.request_id, []).append(i)
            for rid, idx in rows.items():
                o.on_logits(step, rid, logits[idx].float().clone())

    def step_end(self, step: int, appended, finished) -> None:
        tokens = {req.request_id: req.output_token_ids[len(req.output_token_ids) - kept:] for req, kept in appended}
        result = StepResult(step, tokens, tuple(r.request_id for r in finished))
        for o in self.observers:
            o.on_step_end(result)


class PlantedSlowdown(StepObserver):
    """Makes every model step ``fraction`` slower (0.10: each step takes 10 % longer): it times
    the step from its schedule to its end and then sleeps that fraction of it. A known regression
    to plant, so a comparison's power can be measured (benchmarks/bench_compare_noise.py) and a
    lab can watch a gate catch it; it changes no token."""

    def __init__(self, fraction: float):
        if not 0 <= fraction <= 10:
            raise ValueError(f"fraction must be in [0, 10] (0.1 = 10 % slower), got {fraction}")
        self.fraction = fraction
        self.slept_s = 0.0
        self._start: float | None = None

    def on_schedule(self, batch: ScheduledBatch) -> None:
        self._start = time.perf_counter()

    def on_step_end(self, result: StepResult) -> None:
        if self._start is None:
            return
        extra = self.fraction * (time.perf_counter() - self._start)
        self._start = None
        time.sleep(extra)
        self.slept_s += extra
