"""Scheduling policies: the orders the scheduler follows, as classes behind a registry.

The scheduler (engine/scheduler.py) owns the mechanics: the token budget, seats, KV blocks,
chunked prefill, preemption by recompute. A policy decides only *who goes first*:

- :meth:`SchedulingPolicy.key`: the order of the waiting queue and of running requests when they
  take the step's budget (smallest first). ``key = None`` (FCFS) keeps arrival order, a plain
  deque, with a preempted request back at the front. With a key the queue is kept sorted
  (a preempted request re-enters by its key) and running prefill chunks that rank below the head
  of the queue wait until the queue's better-ranked requests were admitted. A waiting request's
  key must not change while it waits (the queue is sorted once, on insertion).
- :meth:`SchedulingPolicy.preemption_victim`: whom to preempt when the KV pool runs dry (FCFS:
  the newest running request, vLLM's default; with a key: the largest key).
- :meth:`SchedulingPolicy.may_preempt`: whether a waiting request that finds no seat or no blocks
  may preempt a running one (FCFS: never; priority: a strictly lower priority).

Built in, with vLLM's names and meanings: ``"fcfs"`` and ``"priority"`` (engine/scheduler.py's
docstring). Register your own, then name it like a built-in::

    minserve.register_scheduling_policy("sjf", ShortestJobFirst)   # or "mypkg.sched:ShortestJobFirst"
    LLM("tiny-llama", scheduling_policy="sjf")

``EngineConfig(scheduling_policy=...)`` and ``minserve serve --scheduling-policy`` take a
registered name, a qualified name (``"package.module:Class"``) or the class itself.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Callable

from minserve.engine.plugins import is_qualified_name, load_class

if TYPE_CHECKING:
    from minserve.engine.request import Request


def priority_key(req: "Request") -> tuple:
    """The order of ``scheduling_policy="priority"``: lower value first, then earlier arrival
    (vLLM's ``Request.__lt__``: priority, arrival time, request id)."""
    return (req.priority, req.arrival_s, req.request_id)


class SchedulingPolicy:
    """Subclass and override what differs from first come, first served (see the module doc).
    Built once per scheduler as ``cls(config)`` (the engine's EngineConfig)."""

    name = "fcfs"
    # The sort key of a policy that orders requests: a method ``key(self, req) -> tuple``
    # (unique per request: end it with the request id). None: arrival order.
    key: Callable[["Request"], tuple] | None = None

    def __init__(self, config=None) -> None:
        self.config = config

    def preemption_victim(self, running: list["Request"]) -> "Request":
        """The running request to preempt when blocks run out (``running`` in admission order)."""
        return max(running, key=self.key) if self.key is not None else running[-1]

    def may_preempt(self, waiting: "Request", running: "Request") -> bool:
        """May ``waiting`` (no seat or no blocks free) preempt ``running``? Never, by default."""
        return False


class FCFSPolicy(SchedulingPolicy):
    """First come, first served (vLLM's default): arrival order, the newest is preempted first."""
    name = "fcfs"


class PriorityPolicy(SchedulingPolicy):
    """vLLM's "priority": lower ``priority`` first, ties by arrival; the lowest-priority, latest
    running request is preempted first; a waiting request preempts strictly lower priorities."""
    name = "priority"

    def key(self, req: "Request") -> tuple:
        return priority_key(req)

    def may_preempt(self, waiting: "Request", running: "Request") -> bool:
        return running.priority > waiting.priority


BUILTIN_POLICIES = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}
_registry: dict[str, type | str] = dict(BUILTIN_POLICIES)


def register_scheduling_policy(name: str, policy: type | str) -> None:
    """Make ``name`` usable as ``scheduling_policy``: a SchedulingPolicy subclass, or its
    qualified name (imported when an engine first uses it). Re-registering a name replaces it;
    the built-in names cannot be replaced."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a scheduling policy name must be an identifier, got {name!r}")
    if name in BUILTIN_POLICIES:
        raise ValueError(f"scheduling policy {name!r} is built in and cannot be replaced")
    if isinstance(policy, str):
        if not is_qualified_name(policy):
            raise ValueError(f"policy must be a SchedulingPolicy subclass or 'package.module:Class', got {policy!r}")
    else:
        load_class(policy, SchedulingPolicy, f"scheduling policy {name!r}")
    _registry[name] = policy


def unregister_scheduling_policy(name: str) -> None:
    """Forget a registered policy (tests and notebooks that register temporary ones)."""
    if name in BUILTIN_POLICIES:
        raise ValueError(f"scheduling policy {name!r} is built in and cannot be removed")
    _registry.pop(name, None)


def registered_scheduling_policies() -> list[str]:
    """The names ``scheduling_policy`` accepts, built-ins first."""
    return list(_registry)


def resolve_scheduling_policy(spec) -> type[SchedulingPolicy]:
    """A registered name, a qualified name or a class -> the SchedulingPolicy subclass."""
    if isinstance(spec, type):
        return load_class(spec, SchedulingPolicy, "scheduling_policy")
    if isinstance(spec, str) and spec in _registry:
        return load_class(_registry[spec], SchedulingPolicy, f"scheduling_policy {spec!r}")
    if is_qualified_name(spec):
        return load_class(spec, SchedulingPolicy, "scheduling_policy")
    raise ValueError(f"scheduling_policy must be one of {registered_scheduling_policies()}, got {spec!r} "
                     "(register one with minserve.register_scheduling_policy, or give 'package.module:Class')")


def make_scheduling_policy(spec, config=None) -> SchedulingPolicy:
    """The policy object a scheduler follows, from ``EngineConfig.scheduling_policy``."""
    return resolve_scheduling_policy(spec)(config)


class SortedQueue:
    """The waiting queue of a policy with a key: a list kept sorted by it, with the deque
    operations the scheduler uses. ``appendleft`` (a preempted request) inserts in order too.
    A sorted list rather than a heap: it iterates in order (the metrics and the deadline model
    read the queue front to back) and removal (abort) is one search."""

    def __init__(self, key: Callable[["Request"], tuple] = priority_key) -> None:
        self._key = key
        self._items: list[Request] = []

    def append(self, req: "Request") -> None:
        bisect.insort(self._items, req, key=self._key)

    appendleft = append

    def popleft(self) -> "Request":
        return self._items.pop(0)

    def remove(self, req: "Request") -> None:
        self._items.remove(req)

    def __getitem__(self, i: int) -> "Request":
        return self._items[i]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(self._items)

    def __contains__(self, req) -> bool:
        return req in self._items
