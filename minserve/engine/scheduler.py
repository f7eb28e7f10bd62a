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
4. Parallel sampling (n > 1): a request whose prompt ends in this step forks its other samples,
   which share its prompt blocks (``_fork_samples``; engine/parallel_sampling.py).

When the KV pool runs dry the newest running request is preempted: its blocks go back to the pool
and it returns to the front of the queue to be recomputed later (prompt plus what it has generated
so far), the policy vLLM uses by default. The scheduler never runs the model: it only decides, so
the same code can drive a simulated executor.

Who goes first is the scheduling policy's decision (engine/scheduling_policy.py: a class behind a
registry, so an experiment can add its own); the mechanics here are the same for every policy.
``scheduling_policy="priority"`` (vLLM's name and meaning) changes three orders, and nothing else:
- the waiting queue is kept sorted by ``(priority, arrival, request_id)``: a lower ``priority``
  value runs first, ties go first come, first served. A preempted request goes back into that same
  order (not to the front: a preempted batch request must not jump ahead of waiting interactive ones);
- the KV victim is the running request with the largest ``(priority, arrival)``, the lowest
  priority and the latest arrival among them, as in vLLM V1 (``max(running, key=...)``);
- running requests take the step's budget in that order too (decodes, then prefill chunks), and
  prefill chunks of running requests that rank below the head of the queue wait until the queue's
  higher-priority requests were admitted: a long low-priority prompt cannot take the budget a
  high-priority arrival needs.
On top of vLLM V1, which only preempts when a *running* request needs blocks, a waiting request
that finds no free seat (``max_num_seqs``) or no KV blocks preempts running requests of a strictly
lower priority (a larger value), lowest first, as vLLM V0's priority policy did. Without it a high-
priority request behind a full batch waits for a low-priority one to finish: its TTFT becomes the
length of a whole batch answer. Equal priorities never preempt each other, so there is no churn
within a class.
"""

from __future__ import annotations

import time
from collections import deque

from minserve.config import EngineConfig
from minserve.engine.kv_cache import KVCacheManager
from minserve.engine.request import Request, RequestStatus
from minserve.engine.scheduling_policy import SortedQueue, make_scheduling_policy, priority_key  # noqa: F401
from minserve.engine.step_io import (AcceptedTokens, ModelRunnerOutput, ScheduledRequest, SchedulerOutput,
                                     StepUpdate)

# The priority policy's queue under its older name (tests and notebooks import it from here).
PriorityQueue = SortedQueue


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int | None = None,
                 num_lookahead_tokens: int = 0):
        self.config = config
        self.kv = kv
        # Positions a request may reach (proposals are cut to stay below it) and the KV slots
        # reserved beyond a sampling request's scheduled tokens, so that the proposals of its next
        # step find blocks ready (speculative decoding sets it to k).
        self.max_model_len = max_model_len
        self.num_lookahead_tokens = num_lookahead_tokens
        # Who goes first (engine/scheduling_policy.py); ``key`` None: arrival order.
        self.policy = make_scheduling_policy(config.scheduling_policy, config)
        self.key = self.policy.key
        self.waiting: deque[Request] | SortedQueue = SortedQueue(self.key) if self.key is not None else deque()
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
        later: list[Request] = []
        key = self.key
        if key is not None:
            # Running prefill chunks ranked below the head of the queue come after its admission,
            # or a long low-priority prompt would take the budget a high-priority arrival needs
            # (its TTFT would grow by the whole prefill).
            decodes.sort(key=key)
            prefills.sort(key=key)
            if self.waiting:
                head = key(self.waiting[0])
                later = [r for r in prefills if key(r) > head]
                prefills = prefills[:len(prefills) - len(later)]
        budget = self._schedule_running(decodes + prefills, out, budget)
        if not out.preempted:
            budget = self._admit_waiting(out, budget, before=key(later[0]) if later else None)
        if later:
            budget = self._schedule_running(later, out, budget)
            if not out.preempted:
                self._admit_waiting(out, budget)
        self._fork_samples(out)
        return out

    def _fork_samples(self, out: SchedulerOutput) -> None:
        """Parallel sampling: fork the waiting samples off each request whose prompt ends in this
        step (engine/parallel_sampling.py). Done last, when no preemption can unschedule the
        request any more; seats and copy blocks go to the samples in index order while they last
        (the others draw their first token all the same, then wait in the queue)."""
        seats = self.config.max_num_seqs - len(self.running)
        for s in out.scheduled:
            req = s.request
            if not (s.needs_sampling and req.unforked_samples):
                continue
            # A sample aborted on its own before the fork stays out.
            s.forks = [child for child in req.unforked_samples if not child.finished]
            req.unforked_samples = []
            for child in s.forks:
                copies = self.kv.fork(req.request_id, child.request_id, req.num_tokens) if seats else None
                if copies is None:
                    break
                s.block_copies += copies
                s.num_seated_forks += 1
                seats -= 1

    def _schedule_running(self, reqs: list[Request], out: SchedulerOutput, budget: int) -> int:
        for req in reqs:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            spec = self._proposals(req, budget)
            fits = self._reserve(req, n + len(spec), out)
            budget += self._unschedule_preempted(out)
            if fits:
                out.scheduled.append(ScheduledRequest(req, n + len(spec), req.num_computed_tokens, spec))
                budget -= n + len(spec)
        return budget

    def _proposals(self, req: Request, budget: int) -> list[int]:
        """The proposals a decoding request verifies this step, cut so that the verify step fits
        the budget whole (never split into chunks), never produces more than ``max_tokens``
        and never passes ``max_model_len``."""
        if not req.spec_token_ids or req.num_tokens - req.num_computed_tokens != 1:
            return []
        k = min(len(req.spec_token_ids), budget - 1, req.max_tokens - req.num_output_tokens - 1)
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - req.num_tokens)
        return req.spec_token_ids[:max(0, k)]

    def _reserve(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Find KV blocks for ``n`` more tokens of a running request (plus the lookahead slots
        when it samples), preempting the newest running requests until they fit. False if
        ``req`` itself had to be preempted."""
        end = req.num_computed_tokens + n
        if end >= req.num_tokens:
            end += self.num_lookahead_tokens
        while not self.kv.allocate_slots(req.request_id, end):
            victim = self.policy.preemption_victim(self.running)
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
        req.spec_token_ids = []
        req.num_preemptions += 1
        req.timeline.preempted_s.append(time.perf_counter())
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, before: tuple | None = None) -> int:
        """Admit from the head of the queue while budget, seats and blocks last (with a policy
        key, only requests ordered ``before`` the given key). Returns the budget left."""
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if before is not None and self.key(req) >= before:
                break
            if len(self.running) >= self.config.max_num_seqs:
                victim = next(iter(self._victims_for(req)), None)
                if victim is None:
                    break
                self._preempt(victim)
                out.preempted.append(victim)
                budget += self._unschedule_preempted(out)
                continue
            try:
                # Prompt logprobs need every prompt row computed: no prefix-cache hit (as in vLLM).
                cached = [] if req.params.prompt_logprobs is not None else self.kv.find_cached_prefix(req)
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
                if self._make_room(req, hit + n, cached, out):
                    budget = self.config.max_num_batched_tokens - sum(x.num_new_tokens for x in out.scheduled)
                    continue  # victims freed blocks (and maybe budget): look at the head again
                break  # wait for running requests to finish and free blocks
            self.waiting.popleft()
            if self.kv.enable_prefix_caching and req.params.prompt_logprobs is None:  # looked up
                out.prefix_cache_queries += req.num_tokens
                out.prefix_cache_hits += hit
            if not req.timeline.scheduled_s:
                req.num_cached_tokens = hit
            req.num_computed_tokens = hit
            req.prefill_end = req.num_tokens
            req.status = RequestStatus.RUNNING
            req.timeline.scheduled_s.append(time.perf_counter())
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, hit))
            budget -= n
        return budget

    def _victims_for(self, req: Request) -> list[Request]:
        """The running requests a waiting ``req`` may preempt (the policy's ``may_preempt``; under
        "priority" the strictly lower priorities), first victim first: largest key, or newest."""
        allowed = [r for r in self.running if self.policy.may_preempt(req, r)]
        return sorted(allowed, key=self.key, reverse=True) if self.key is not None else allowed[::-1]

    def _make_room(self, req: Request, num_tokens: int, cached: list[int], out: SchedulerOutput) -> bool:
        """Preempt the running requests the policy lets ``req`` preempt (under "priority": lower
        priorities) until the waiting ``req``'s blocks fit. Only starts when all of them together
        would free enough (blocks held by them alone), so no work is thrown away for nothing.
        True if anything was preempted."""
        victims = self._victims_for(req)
        if not victims:
            return False
        ref = self.kv.pool.ref_count

        def need() -> int:  # as allocate_slots counts: new blocks plus cached ones to revive
            return (self.kv.blocks_needed(req.request_id, num_tokens) - len(cached)
                    + sum(1 for b in cached if ref[b] == 0))
        freeable = sum(1 for r in victims for b in self.kv.block_tables.get(r.request_id, ()) if ref[b] == 1)
        if not victims or need() > self.kv.pool.num_free + freeable:
            return False
        for victim in victims:
            self._preempt(victim)
            out.preempted.append(victim)
            self._unschedule_preempted(out)
            if need() <= self.kv.pool.num_free:
                break
        return True

    # ---- after the step -------------------------------------------------------------------
    #
    # Booking a step takes two calls with the engine's output processor between them, so that
    # nothing calls back from here into the engine:
    #   update = scheduler.update_from_output(sched, out)   # counts move, proposals roll back
    #   for a in update.accepted: a.keep(*output_processor(a.request, a.tokens))
    #   scheduler.settle(update)                              # blocks published, forks started

    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> StepUpdate:
        """Book a step's results: the one place where token counts move. For each request:
        advance ``num_computed_tokens`` by what was computed, roll back the rejected proposals
        and list the accepted tokens in ``update.accepted`` (with the samples forked off it),
        for the engine to append and stop-check. A request that raises here fails alone (listed
        in ``failed``). :meth:`settle` finishes the booking once the tokens are appended."""
        update = StepUpdate()
        for s in sched.scheduled:
            req = s.request
            why = out.errors.get(req.request_id)
            if why is not None:
                update.failed.append((req, why))
                continue
            try:
                tokens = out.sampled.get(req.request_id, [])
                self._book_computed(s, tokens, update)
                forks = [AcceptedTokens(child, out.sampled[child.request_id]) for child in s.forks]
                update.accepted.append(AcceptedTokens(req, tokens, forks, s.num_seated_forks,
                                                      s.request.timeline.scheduled_s[0] if forks else None))
            except Exception as e:  # its own data or output: it fails, the others go on
                update.failed.append((req, f"{type(e).__name__}: {e}"))
        return update

    def settle(self, update: StepUpdate) -> None:
        """After the engine appended each request's accepted tokens (``AcceptedTokens.keep``):
        drop the K/V of tokens a stop cut off, publish the blocks now full of final tokens to the
        prefix cache, start the forked samples, and list who got tokens (``appended``) and who
        finished (``finished``, for the engine to retire). A record whose appending failed
        (``error`` set) is skipped: the engine fails that request."""
        for a in update.accepted:
            if a.error is not None:
                continue
            try:
                self._settle_one(a, update)
                if a.forks:
                    self._start_forks(a, update)
            except Exception as e:
                update.failed.append((a.request, f"{type(e).__name__}: {e}"))

    def _book_computed(self, s: ScheduledRequest, tokens: list, update: StepUpdate) -> None:
        req = s.request
        req.num_computed_tokens += s.num_new_tokens
        if s.spec_token_ids:
            rejected = len(s.spec_token_ids) + 1 - len(tokens)
            update.num_accepted_spec_tokens += len(tokens) - 1
            update.num_rejected_spec_tokens += rejected
            update.verified.append((len(s.spec_token_ids), len(tokens) - 1))
            req.num_spec_proposed += len(s.spec_token_ids)
            req.num_spec_accepted += len(tokens) - 1
            self.rollback(req, rejected)
        req.spec_token_ids = []

    def _settle_one(self, a: AcceptedTokens, update: StepUpdate) -> None:
        req = a.request
        if a.tokens:
            update.appended.append((req, a.num_kept))
            # A stop inside the accepted tokens drops the rest: their K/V is not the request's.
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
        self.kv.cache_full_blocks(req)
        if a.status is not None:
            update.finished.append((req, a.status))

    def _start_forks(self, a: AcceptedTokens, update: StepUpdate) -> None:
        """Start the samples forked off ``a.request`` in this step, each with the token it drew
        from the shared logits: seated ones run on with the prompt's K/V in place (shared blocks
        and their copy), the others wait at the front of the queue to recompute it."""
        waiting = []
        for i, fork in enumerate(a.forks):
            child, seated = fork.request, i < a.num_seated_forks
            child.timeline.scheduled_s.append(a.scheduled_s)
            child.status = RequestStatus.RUNNING if seated else RequestStatus.PREEMPTED
            if seated:
                child.num_computed_tokens = child.prefill_end = child.num_prompt_tokens
                self.running.append(child)
            update.appended.append((child, fork.num_kept))
            if fork.status is not None:
                update.finished.append((child, fork.status))
            elif not seated:
                waiting.append(child)
        for child in reversed(waiting):  # appendleft: keep index order at the front
            self.waiting.appendleft(child)

    def rollback(self, req: Request, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` computed tokens of a request (rejected proposals): its
        count moves back and blocks left empty return to the pool. Blocks published to the prefix
        cache hold final tokens only, so a rollback never reaches them."""
        if num_tokens <= 0:
            return
        req.num_computed_tokens -= num_tokens
        assert req.num_computed_tokens >= req.num_registered_blocks * self.kv.block_size, \
            "rollback into a block published to the prefix cache"
        self.kv.trim(req.request_id, req.num_computed_tokens + self.num_lookahead_tokens + 1)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Retire a request (stopped, length, aborted): its blocks return to the pool at once."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.request_id)
        req.status = status
        req.timeline.finished_s = time.perf_counter()
