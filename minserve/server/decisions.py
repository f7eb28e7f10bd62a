"""Decision records: why each request went where it went, and how it ended.

Every request a routed server answers gets one :class:`DecisionRecord`, a request shed at
admission too (on the route that refused it): the route, its precision (weight format and
dtype, KV cache dtype), the decoding policy (speculation on or off), the reason the route was
chosen, and, once it ends, the cache path (prompt tokens served from the prefix cache), its
latencies and its outcome. The same facts go out in response headers:

- ``x-minserve-route: NAME``
- ``x-minserve-decision: reason=canary_share; precision=int4/float32; kv=auto; spec=off``
  (non-streamed answers add ``; cached_tokens=N``: a stream's headers leave before it is known)

How a request ends is one of :data:`OUTCOMES`, kept apart because each calls for a different
response from an operator: ``model_error`` (the engine failed it: a bug or a bad model),
``overload`` (shed at admission, or refused while draining: capacity), ``dependency_failure``
(a part it needs was not running: the engine loop died or stopped), ``client_cancelled`` (the
client left or aborted), ``deadline_exceeded`` (admitted, then too late), ``invalid_request``
(the client's own error), else ``ok``. ``minserve:request_failures{route, reason}`` counts each
non-ok outcome; ``minserve:route_decisions{route, reason}`` counts the routing reasons.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field

ROUTE_REASONS = ("default", "canary_share", "canary_overflow", "explicit", "downgrade_deadline")
OUTCOMES = ("ok", "model_error", "overload", "dependency_failure", "client_cancelled",
            "deadline_exceeded", "invalid_request")
ROUTE_HEADER, DECISION_HEADER = "x-minserve-route", "x-minserve-decision"
ADMISSION_OVERLOAD = ("queue_full_requests", "queue_full_tokens", "kv_budget", "tenant_quota",
                      "deadline", "draining")


def outcome_of(status: int, code: str | None, message: str = "") -> str:
    """The telemetry class of a failed request from its status and error code."""
    if status == 499 or code == "aborted":
        return "client_cancelled"
    if status == 504 or code == "deadline_exceeded":
        return "deadline_exceeded"
    if status == 429 or code in ADMISSION_OVERLOAD:
        return "overload"
    if status == 503:  # not shedding: the engine is not running (stopped, or its loop died)
        return "dependency_failure"
    if 400 <= status < 500:
        return "invalid_request"
    return "model_error"


@dataclass
class DecisionRecord:
    request_id: str
    route: str
    reason: str
    priority_class: str
    tenant: str
    precision: str
    kv_cache_dtype: str
    speculation: bool
    arrived_s: float = field(default_factory=time.time)
    cached_tokens: int | None = None
    outcome: str | None = None               # None while in flight
    status: int | None = None
    finish_reasons: list = field(default_factory=list)
    output_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def headers(self) -> dict[str, str]:
        spec = "on" if self.speculation else "off"
        text = f"reason={self.reason}; precision={self.precision}; kv={self.kv_cache_dtype}; spec={spec}"
        if self.cached_tokens is not None:
            text += f"; cached_tokens={self.cached_tokens}"
        return {ROUTE_HEADER: self.route, DECISION_HEADER: text}

    @property
    def bad_answer(self) -> bool:
        """The quality proxy: an answer that is empty or was cut at max_tokens."""
        return self.output_tokens == 0 or "length" in self.finish_reasons


def precision_of(config) -> str:
    """``int4/float32``: the weight format (quantization, or "none") over the compute dtype."""
    return f"{config.quantization or 'none'}/{config.dtype}"


class DecisionLog:
    """The most recent records, bounded (memory stays flat however long the server runs)."""

    def __init__(self, maxlen: int = 10_000):
        self._records: deque[DecisionRecord] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def add(self, record: DecisionRecord) -> None:
        with self._lock:
            self._records.append(record)

    def recent(self, limit: int | None = None) -> list[dict]:
        with self._lock:
            items = list(self._records)
        return [asdict(r) for r in (items if limit is None else items[-limit:])]


class RoutingMetrics:
    """The ``minserve:*`` routing series, in the server's own registry (routed_app.py)."""

    def __init__(self, registry, routes: list[str]):
        from prometheus_client import Counter, Gauge
        self.decisions = Counter("minserve:route_decisions", "Requests routed, by route and reason.",
                                 ["route", "reason"], registry=registry)
        self.failures = Counter("minserve:request_failures",
                                "Requests that did not end ok, by route and reason (model_error, overload, "
                                "dependency_failure, client_cancelled, deadline_exceeded, invalid_request).",
                                ["route", "reason"], registry=registry)
        self.canary_decisions = Counter("minserve:canary_decisions",
                                        "Canary state changes, by route, decision and criterion.",
                                        ["route", "decision", "criterion"], registry=registry)
        self.canary_share = Gauge("minserve:canary_share", "Share of eligible traffic sent to the canary.",
                                  ["route"], registry=registry)
        for r in routes:  # every series exported at 0 before the first event
            for reason in ROUTE_REASONS:
                self.decisions.labels(r, reason)
            for reason in OUTCOMES[1:]:
                self.failures.labels(r, reason)
