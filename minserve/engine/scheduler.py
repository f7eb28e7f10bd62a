"""Iteration-level (continuous) batching with chunked prefill and recompute preemption.

Every step the scheduler builds a fresh batch under two limits: ``max_num_batched_tokens`` (the
token budget of one forward pass) and ``max_num_seqs`` (how many requests may hold a place in the
running set). Finished requests have already left; waiting ones join as soon as budget and KV
blocks allow, so the batch never waits for its slowest member as a static batch does.

Order inside a step, and why:
1. Running requests that are decoding, one token each. They go first so a long prompt arriving
   never stalls streams already in flight (it only shares the step with them).
2. Running requests still in prefill: their next chunk, as large as the remaining budget allows.
3. Waiting requests, oldest first (preempted ones at the front), while budget, seats and blocks last.
   On admission the prefix cache is consulted: cached blocks join the request's block table and
   only the tokens after them are computed.

When the KV pool runs dry the newest running request is preempted: its blocks go back to the pool
and it returns to the front of the queue to be recomputed later (prompt plus what it has generated
so far), the policy vLLM uses by default. The scheduler never runs the model: it only decides, so
the same code can drive a simulated executor.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from minserve.config import EngineConfig
from minserve.engine.kv_cache import KVCacheManager
from minserve.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int     # tokens computed for it this step
    context_len: int        # tokens already in its KV cache before this step
    samples: bool = False   # reaches the end of its known tokens, so a token is sampled

    def __post_init__(self) -> None:
        # Fixed at scheduling time: after the step the request has grown by the sampled token.
        self.samples = self.context_len + self.num_new_tokens == self.request.num_tokens


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
        return sum(s.num_new_tokens for s in self.scheduled if s.num_new_tokens > 1 or not s.samples)

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if s.num_new_tokens == 1 and s.samples)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []      # in admission order: the last is the newest
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        decodes = [r for r in self.running if not r.is_prefill]
        prefills = [r for r in self.running if r.is_prefill]
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            fits = self._reserve(req, n, out)
            budget += self._unschedule_preempted(out)
            if fits:
                out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens))
                budget -= n
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _reserve(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Find KV blocks for ``n`` more tokens of a running request, preempting the newest
        running requests until they fit. False if ``req`` itself had to be preempted."""
        while not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    @staticmethod
    def _unschedule_preempted(out: SchedulerOutput) -> int:
        """Drop requests preempted after being scheduled in this same step; return their tokens."""
        kept = [s for s in out.scheduled if s.request.status is RequestStatus.RUNNING]
        freed = sum(s.num_new_tokens for s in out.scheduled) - sum(s.num_new_tokens for s in kept)
        out.scheduled = kept
        return freed

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0     # recompute: its K/V is gone (cached blocks may survive)
        req.num_registered_blocks = 0
        req.num_preemptions += 1
        req.timeline.preempted_s.append(time.perf_counter())
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            try:
                cached = self.kv.find_cached_prefix(req)
            except Exception as e:  # this request's own data is bad: it must not block the queue
                self.waiting.popleft()
                out.failed.append((req, f"{type(e).__name__}: {e}"))
                continue
            hit = len(cached) * self.kv.block_size
            remaining = req.num_tokens - hit
            n = min(remaining, budget)
            if n < remaining and not self.config.enable_chunked_prefill:
                break
            if not self.kv.allocate_slots(req.request_id, hit + n, cached):
                break  # wait for running requests to finish and free blocks
            self.waiting.popleft()
            if self.kv.enable_prefix_caching:
                out.prefix_cache_queries += req.num_tokens
                out.prefix_cache_hits += hit
            if not req.timeline.scheduled_s:
                req.num_cached_tokens = hit
            req.num_computed_tokens = hit
            req.status = RequestStatus.RUNNING
            req.timeline.scheduled_s.append(time.perf_counter())
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, hit))
            budget -= n

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Retire a request (stopped, length, aborted): its blocks return to the pool at once."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.request_id)
        req.status = status
        req.timeline.finished_s = time.perf_counter()
