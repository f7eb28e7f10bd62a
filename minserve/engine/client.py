"""The narrow interface a server drives an engine through (server/async_engine.py).

A server needs little of the engine: queue a request, abort one, run a step, and a read-only look
at the work in flight (which requests run, how much each has left, whether an id is still held).
Naming exactly that keeps the server off the engine's internals (the scheduler's queues, the
request tables), so those can change without the server noticing, and lets a test drive the server
with a stand-in engine that implements only this (tests/test_server_async_engine.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

from minserve.engine.request import RequestStatus
from minserve.outputs import RequestOutput


@dataclass(frozen=True)
class RunningWork:
    """The work in flight after a step, read-only: the ids of the running requests, how many wait,
    and per running request (then per preempted one, waiting at the front of the queue to
    recompute) the prompt tokens it has left to compute and the output tokens it may still make
    (what the server's deadline model needs: server/admission.py, deadlines.py)."""
    running_ids: tuple[str, ...] = ()
    num_waiting: int = 0
    remaining: tuple[tuple[int, int], ...] = ()

    @property
    def num_running(self) -> int:
        return len(self.running_ids)


class EngineClient(Protocol):
    """What server/async_engine.py calls, all of it on the engine thread. LLMEngine implements it
    (the view methods come from :class:`EngineClientView`)."""

    last_step_stats: object            # StepStats of the latest step, or None
    last_step_failures: dict[str, str]   # request id -> why it failed in the latest step
    last_step_client_errors: set[str]    # of those, the failures the request itself caused

    def add_request(self, request_id: str, prompt, params, *, cache_salt: str | None = None,
                    priority: int = 0) -> None: ...

    def abort_request(self, request_id: str | list[str]) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def running_work(self) -> RunningWork: ...

    def holds_request(self, request_id: str) -> bool: ...


class EngineClientView:
    """LLMEngine's read-only view for a server (mixed in; reads ``scheduler``, ``requests``,
    ``parents`` and ``kv`` of the engine)."""

    def running_work(self) -> RunningWork:
        sched = self.scheduler
        # Preempted requests wait at the front of the queue to recompute; they are work ahead too.
        preempted = itertools.takewhile(lambda r: r.status is RequestStatus.PREEMPTED, sched.waiting)
        remaining = tuple((r.num_tokens - r.num_computed_tokens if r.is_prefill else 0,
                           max(0, r.max_tokens - r.num_output_tokens))
                          for r in itertools.chain(sched.running, preempted))
        return RunningWork(tuple(r.request_id for r in sched.running), len(sched.waiting), remaining)

    def holds_request(self, request_id: str) -> bool:
        """The engine still holds this id: a request not finished, or one with n > 1 while any
        of its samples is unfinished."""
        return request_id in self.requests or request_id in self.parents

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's ``reset_prefix_cache``): the next request
        prefills its whole prompt, as on a fresh server. Like vLLM, it refuses (returns False,
        nothing changed) while any request is unfinished (KVCacheManager.reset_prefix_cache)."""
        return not self.has_unfinished_requests() and self.kv.reset_prefix_cache()
