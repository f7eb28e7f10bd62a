"""Admission control: decide at the door whether a request may wait for the engine.

Continuous batching makes the engine efficient, not infinite. Without a bound, an overload turns
into an ever longer waiting queue, and client timeouts silently become the capacity policy: every
request waits, most give up, and the engine spends its time on answers nobody reads. So each
request is classified when it arrives and either admitted into a bounded waiting room or shed at
once with an explicit answer (429 + ``Retry-After``, or 503 while the server drains).

Classification (:func:`classify`):

- tenant: with API keys configured, the authenticated key's tenant (auth.py); otherwise the API
  key (``Authorization: Bearer ...``, stored only as a short hash so keys never reach logs), else
  the body's ``user`` field, else ``"anonymous"``. The tenant also salts the prefix cache;
- priority class: the ``x-priority-class`` header (``interactive`` | ``batch``) if given, else the
  body's ``priority`` field: ``<= 0`` is interactive, ``> 0`` is batch. This follows vLLM, where a
  lower ``priority`` value is served earlier and the default is 0;
- size: prompt tokens and ``max_tokens`` (the output bound), hence predicted KV bytes;
- deadline: ``x-deadline-ms`` header or ``deadline_ms`` body field, the time within which the whole
  answer must be finished, counted from arrival.

Budgets (:class:`ClassLimits`), separate for each priority class, so a flood of batch work cannot
take the waiting room from interactive users: queued requests, queued tokens (prompt + max_tokens)
and queued KV bytes (those tokens x the engine's KV bytes per token: what the request will pin in
the cache at its longest). "Queued" means admitted but not yet scheduled by the engine; once the
engine runs a request, it is bounded by the engine's own limits (max_num_seqs, KV blocks).
A per-tenant quota bounds in-flight requests (queued or running) of one tenant across classes.

Deadline model (deadlines.py, stated there): a request with a deadline is shed when its predicted
completion misses it. The prediction counts the work of the requests the engine is running (which
the engine thread reports after every step, :meth:`AdmissionController.observe_running`), the
wait for a free seat when all ``max_num_seqs`` are busy, and the admitted requests queued ahead
(every class: the engine is first come, first served). Its rates, prefill seconds per token,
seconds per decode step and output tokens a decoding request gains per step (1 without
speculative decoding), are exponentially weighted moving averages of recent engine steps
(:meth:`AdmissionController.observe_step`), starting from configured priors.

After admission the deadline still holds, in every state: a request still queued, running, or
preempted and waiting to recompute when its deadline passes is aborted (async_engine.py enforces
it on the engine thread, so its KV blocks go back to the pool at once), its client gets 504
``deadline_exceeded`` (an error event on a stream already under way), and
:meth:`AdmissionController.record_expired` counts it. An answer past its deadline is worth
nothing to the client that set it, and every further step it took would be taken from others.

The controller is pure logic (no HTTP, no engine), guarded by one lock because the HTTP loop
admits and releases while the engine thread reports started requests and step times.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Mapping

from minserve.server import deadlines

log = logging.getLogger("minserve.server")

INTERACTIVE, BATCH = "interactive", "batch"
PRIORITY_CLASSES = (INTERACTIVE, BATCH)
REJECT_REASONS = ("queue_full_requests", "queue_full_tokens", "kv_budget", "tenant_quota",
                  "deadline", "draining", "request_too_large")


@dataclass(frozen=True)
class ClassLimits:
    """The waiting-room budget of one priority class; None means unbounded."""

    max_queued_requests: int | None = 256
    max_queued_tokens: int | None = None
    max_queued_kv_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_queued_requests", "max_queued_tokens", "max_queued_kv_bytes"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {v!r}")


@dataclass
class AdmissionConfig:
    interactive: ClassLimits = field(default_factory=ClassLimits)
    batch: ClassLimits = field(default_factory=ClassLimits)
    tenant_max_inflight: int | None = None
    parallel_slots: int = 1              # the engine's max_num_seqs
    kv_bytes_per_token: int = 0          # the engine's kv_spec.bytes_per_token
    # Priors for the deadline model until engine steps have been measured (CPU-ish numbers).
    prior_prefill_s_per_token: float = 1e-3
    prior_decode_s_per_step: float = 0.05
    ewma_alpha: float = 0.2              # weight of the newest step in the moving averages
    max_retry_after_s: int = 60
    drain_retry_after_s: int = 5

    def __post_init__(self) -> None:
        if self.tenant_max_inflight is not None and self.tenant_max_inflight < 1:
            raise ValueError(f"tenant_max_inflight must be >= 1 or None, got {self.tenant_max_inflight}")
        if self.parallel_slots < 1:
            raise ValueError(f"parallel_slots must be >= 1, got {self.parallel_slots}")
        if not 0 < self.ewma_alpha <= 1:
            raise ValueError(f"ewma_alpha must be in (0, 1], got {self.ewma_alpha}")

    def limits(self, priority_class: str) -> ClassLimits:
        return self.interactive if priority_class == INTERACTIVE else self.batch


@dataclass
class Ticket:
    """One request as admission sees it. ``state``: new -> queued -> running -> released."""

    tenant: str
    priority_class: str
    prompt_tokens: int
    max_tokens: int
    deadline_s: float | None = None
    state: str = "new"
    waited_s: float = 0.0                # spent before admission (tokenizing): part of the deadline

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens


@dataclass(frozen=True)
class Decision:
    admitted: bool
    reason: str | None = None
    status: int = 200                    # HTTP status for a rejection: 429, 503 or 400
    message: str = ""
    retry_after_s: int | None = None
    predicted_s: float | None = None


@dataclass
class _Queue:
    """Running sums of one class's waiting room (sums, not lists: O(1) admit and release)."""

    requests: int = 0
    prompt_tokens: int = 0
    max_tokens: int = 0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens

    def add(self, t: Ticket, sign: int) -> None:
        self.requests += sign
        self.prompt_tokens += sign * t.prompt_tokens
        self.max_tokens += sign * t.max_tokens


def tenant_of(authorization: str | None, user: str | None) -> str:
    """API key (hashed) > ``user`` field > "anonymous"."""
    if authorization:
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and key.strip():
            return "key-" + hashlib.sha256(key.strip().encode()).hexdigest()[:12]
    if isinstance(user, str) and user:
        return "user-" + user
    return "anonymous"


def classify(headers: Mapping[str, str], *, user: str | None, priority: int,
             deadline_ms: float | None, prompt_tokens: int, max_tokens: int,
             tenant: str | None = None, max_class: str | None = None) -> Ticket:
    """Build the ticket of one request; ValueError (naming the header or field) on bad input.
    ``headers`` must answer lower-case names (Starlette's Headers does). ``tenant`` and
    ``max_class`` come from an authenticated API key (auth.py): the tenant then ignores the
    ``user`` field, and the class asked for is capped at ``max_class`` (a batch key asking for
    interactive is served as batch rather than refused, since priority 0, the default, asks for
    interactive)."""
    header_class = headers.get("x-priority-class")
    if header_class is not None:
        priority_class = header_class.strip().lower()
        if priority_class not in PRIORITY_CLASSES:
            raise ValueError(f"header x-priority-class must be one of {list(PRIORITY_CLASSES)}, "
                             f"got {header_class!r}")
    else:
        priority_class = INTERACTIVE if priority <= 0 else BATCH
    rank = PRIORITY_CLASSES.index  # most urgent first
    if max_class is not None and rank(priority_class) < rank(max_class):
        priority_class = max_class
    header_deadline = headers.get("x-deadline-ms")
    source = "deadline_ms"  # errors name where the bad value came from
    if header_deadline is not None:
        source = "header x-deadline-ms"
        try:
            deadline_ms = float(header_deadline)
        except ValueError:
            deadline_ms = math.nan
    if deadline_ms is not None and not (math.isfinite(deadline_ms) and deadline_ms > 0):
        got = header_deadline if header_deadline is not None else deadline_ms
        raise ValueError(f"{source} must be a finite number of milliseconds > 0, got {got!r}")
    return Ticket(tenant or tenant_of(headers.get("authorization"), user), priority_class, prompt_tokens,
                  max_tokens, None if deadline_ms is None else deadline_ms / 1000.0)


class AdmissionController:
    def __init__(self, config: AdmissionConfig | None = None, registry=None):
        self.config = config or AdmissionConfig()
        self._lock = threading.Lock()
        self._queues = {c: _Queue() for c in PRIORITY_CLASSES}
        self._waiting: dict[int, Ticket] = {}        # queued tickets by id(), in admission order
        self._running: list[deadlines.Work] = []     # the engine's last report (observe_running)
        self._inflight: dict[str, int] = {}
        self.prefill_s_per_token = self.config.prior_prefill_s_per_token
        self.decode_s_per_step = self.config.prior_decode_s_per_step
        self.decode_tokens_per_step = 1.0  # output tokens a decoding request gains per step
        self.draining = False
        self._metrics = _AdmissionMetrics(registry) if registry is not None else None

    # ---- decisions ---------------------------------------------------------------------------

    def try_admit(self, t: Ticket) -> Decision:
        """Admit ``t`` into its class's waiting room, or say why not. Admitted tickets must be
        :meth:`release`d exactly once when the request ends, whatever the outcome."""
        with self._lock:
            decision = self._decide(t)
            if decision.admitted:
                t.state = "queued"
                self._queues[t.priority_class].add(t, +1)
                self._waiting[id(t)] = t
                self._inflight[t.tenant] = self._inflight.get(t.tenant, 0) + 1
            self._record(t, decision)
            return decision

    def _decide(self, t: Ticket) -> Decision:
        if self.draining:
            return Decision(False, "draining", 503, "the server is shutting down; retry on another "
                            "replica", self.config.drain_retry_after_s)
        too_large = self._too_large(t)
        if too_large:
            return Decision(False, "request_too_large", 400, too_large)
        cfg, q = self.config, self._queues[t.priority_class]
        limits = cfg.limits(t.priority_class)
        used = self._inflight.get(t.tenant, 0)
        if cfg.tenant_max_inflight is not None and used >= cfg.tenant_max_inflight:
            return Decision(False, "tenant_quota", 429, f"tenant has {used} requests in flight, "
                            f"the quota is {cfg.tenant_max_inflight}", 1)
        checks = (("queue_full_requests", q.requests, 1, limits.max_queued_requests, "requests"),
                  ("queue_full_tokens", q.tokens, t.tokens, limits.max_queued_tokens, "tokens"),
                  ("kv_budget", q.tokens * cfg.kv_bytes_per_token, t.tokens * cfg.kv_bytes_per_token,
                   limits.max_queued_kv_bytes, "predicted KV bytes"))
        for reason, queued, need, limit, unit in checks:
            if limit is not None and queued + need > limit:
                # The message names the limit and this request's own size, never how much other
                # tenants have queued: a 429 must not be a probe of the others' load.
                return Decision(False, reason, 429, f"the {t.priority_class} queue is full: this "
                                f"request's {need} {unit} do not fit its limit of {limit}",
                                self._retry_after())
        predicted = self._predict_locked(t)
        if t.deadline_s is not None and t.waited_s + predicted > t.deadline_s:
            spent = f" after {t.waited_s * 1000:.0f} ms spent preparing it" if t.waited_s >= 0.001 else ""
            # The prediction is this request's own answer; the work ahead behind it (how many
            # requests others run or queue) is not told to the client (logged at debug level).
            log.debug("deadline shed: %d running, %d queued ahead", len(self._running), len(self._waiting))
            return Decision(False, "deadline", 429, f"predicted completion in {predicted * 1000:.0f} ms"
                            f"{spent} misses the deadline of {t.deadline_s * 1000:.0f} ms",
                            self._retry_after(), predicted)
        return Decision(True, predicted_s=predicted)

    def _too_large(self, t: Ticket) -> str:
        """A request bigger than its class's whole budget could never be admitted: a 429 would
        make the client retry forever, so it is a 400 instead."""
        limits, bpt = self.config.limits(t.priority_class), self.config.kv_bytes_per_token
        if limits.max_queued_tokens is not None and t.tokens > limits.max_queued_tokens:
            return (f"prompt + max_tokens = {t.tokens} tokens exceeds this server's per-request "
                    f"limit of {limits.max_queued_tokens} for the {t.priority_class} class")
        if limits.max_queued_kv_bytes is not None and t.tokens * bpt > limits.max_queued_kv_bytes:
            return (f"prompt + max_tokens = {t.tokens} tokens needs {t.tokens * bpt} KV bytes, over "
                    f"this server's limit of {limits.max_queued_kv_bytes} for the "
                    f"{t.priority_class} class")
        return ""

    @property
    def decode_s_per_token(self) -> float:
        """Seconds for one decoding request to gain one output token: a decode step's time over
        the tokens it brings each request (the deadline model's ``d``, deadlines.py)."""
        return self.decode_s_per_step / self.decode_tokens_per_step

    def _start_s(self) -> float:
        queued = ((q.prompt_tokens, q.max_tokens) for q in self._waiting.values())
        return deadlines.start_s(self._running, queued, self.config.parallel_slots,
                                 self.prefill_s_per_token, self.decode_s_per_token)

    def _predict_locked(self, t: Ticket) -> float:
        return deadlines.finish_s(self._start_s(), t.prompt_tokens, t.max_tokens,
                                  self.prefill_s_per_token, self.decode_s_per_token)

    def predict_s(self, t: Ticket) -> float:
        """Predicted seconds from now until ``t`` would finish if admitted now (module docstring)."""
        with self._lock:
            return self._predict_locked(t)

    def _retry_after(self) -> int:
        """Whole seconds until a new request could start, by the same model."""
        return max(1, min(self.config.max_retry_after_s, math.ceil(self._start_s())))

    # ---- lifecycle -------------------------------------------------------------------------

    def mark_started(self, t: Ticket) -> None:
        """The engine scheduled the request: it leaves the waiting room (keeps its tenant slot)."""
        with self._lock:
            if t.state == "queued":
                t.state = "running"
                self._queues[t.priority_class].add(t, -1)
                self._waiting.pop(id(t), None)
                self._update_gauges(t.priority_class)

    def release(self, t: Ticket) -> None:
        """The request ended (finished, failed, aborted). Idempotent."""
        with self._lock:
            if t.state not in ("queued", "running"):
                return
            if t.state == "queued":
                self._queues[t.priority_class].add(t, -1)
                self._waiting.pop(id(t), None)
            t.state = "released"
            left = self._inflight.get(t.tenant, 0) - 1
            if left > 0:
                self._inflight[t.tenant] = left
            else:
                self._inflight.pop(t.tenant, None)  # keep the dict as small as the active tenants
            self._update_gauges(t.priority_class)

    def observe_step(self, step_time_s: float, num_prefill_tokens: int, num_decode_tokens: int,
                     num_spec_tokens: int = 0, num_accepted_spec_tokens: int = 0) -> None:
        """Fold one engine step into the moving averages of the deadline model.

        The counts are the engine's (StepStats): ``num_prefill_tokens`` and ``num_decode_tokens``
        are rows computed, a decoding request's row plus one per proposal it verified
        (speculative decoding); ``num_spec_tokens`` of those rows were proposals, and
        ``num_accepted_spec_tokens`` proposals were accepted. So the step had
        ``num_decode_tokens - num_spec_tokens`` decoding requests, and they gained that many
        tokens plus the accepted proposals. Without speculative decoding both are 0: one row,
        one token per decoding request per step."""
        a = self.config.ewma_alpha
        with self._lock:
            total = num_prefill_tokens + num_decode_tokens
            if num_prefill_tokens > 0 and total > 0:
                # Rows share the step's compute alike, verified proposals included.
                self.prefill_s_per_token += a * (step_time_s / total - self.prefill_s_per_token)
            decoding = num_decode_tokens - num_spec_tokens
            if decoding > 0:
                # A decoding request gains its tokens in the step's time, whatever else shares
                # the step; the time of one of its tokens is decode_s_per_token.
                self.decode_s_per_step += a * (step_time_s - self.decode_s_per_step)
                gained = (decoding + num_accepted_spec_tokens) / decoding
                self.decode_tokens_per_step += a * (gained - self.decode_tokens_per_step)

    def observe_running(self, work: list[deadlines.Work]) -> None:
        """The engine's running work after a step (engine thread): per request, prompt tokens left
        to compute and output tokens left at most; seat holders first (deadlines.py)."""
        with self._lock:
            self._running = list(work)

    def record_expired(self, t: Ticket) -> None:
        """A request's deadline passed before its answer was complete; it was aborted."""
        if self._metrics is not None:
            self._metrics.deadline_expired[t.priority_class].inc()

    def begin_drain(self) -> None:
        """From now on every new request gets 503; requests already admitted run to the end."""
        with self._lock:
            self.draining = True

    # ---- introspection ---------------------------------------------------------------------

    def queued(self, priority_class: str) -> tuple[int, int]:
        """(requests, tokens) waiting in one class."""
        with self._lock:
            q = self._queues[priority_class]
            return q.requests, q.tokens

    def inflight(self, tenant: str) -> int:
        with self._lock:
            return self._inflight.get(tenant, 0)

    def _record(self, t: Ticket, d: Decision) -> None:
        if self._metrics is None:
            return
        if d.admitted:
            self._metrics.admitted[t.priority_class].inc()
        else:
            self._metrics.rejected.labels(d.reason, t.priority_class).inc()
        self._update_gauges(t.priority_class)

    def _update_gauges(self, priority_class: str) -> None:
        if self._metrics is not None:
            q = self._queues[priority_class]
            self._metrics.queued_requests[priority_class].set(q.requests)
            self._metrics.queued_tokens[priority_class].set(q.tokens)


class _AdmissionMetrics:
    """``minserve:*`` series, registered in the engine's own registry so ``/metrics`` shows them
    next to the ``vllm:*`` ones. Counters are named without ``_total``: prometheus_client adds it."""

    def __init__(self, registry):
        from prometheus_client import Counter, Gauge
        self.rejected = Counter("minserve:admission_rejected", "Requests shed at admission, by reason.",
                                ["reason", "priority_class"], registry=registry)
        admitted = Counter("minserve:admission_admitted", "Requests admitted to the waiting room.",
                           ["priority_class"], registry=registry)
        req = Gauge("minserve:admission_queued_requests", "Admitted requests not yet scheduled.",
                    ["priority_class"], registry=registry)
        tok = Gauge("minserve:admission_queued_tokens",
                    "Prompt + max_tokens of admitted requests not yet scheduled.",
                    ["priority_class"], registry=registry)
        expired = Counter("minserve:admission_deadline_expired",
                          "Admitted requests aborted because their deadline passed (queued, running or preempted).",
                          ["priority_class"], registry=registry)
        # Children created up front so every series is exported (at 0) before the first event.
        self.deadline_expired = {c: expired.labels(c) for c in PRIORITY_CLASSES}
        self.admitted = {c: admitted.labels(c) for c in PRIORITY_CLASSES}
        self.queued_requests = {c: req.labels(c) for c in PRIORITY_CLASSES}
        self.queued_tokens = {c: tok.labels(c) for c in PRIORITY_CLASSES}
        for reason in REJECT_REASONS:
            for c in PRIORITY_CLASSES:
                self.rejected.labels(reason, c)
