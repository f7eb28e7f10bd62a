"""The canary: a bounded share of traffic on a candidate route, watched against the baseline,
rolled back on its own when it breaks criteria fixed before it started.

Each route keeps a window of its most recent finished requests (:class:`RouteWindow`): TTFT,
TPOT and E2E of the ones that ended ok, and per request whether it failed (model error,
dependency failure, deadline missed: what the server did wrong, not overload or cancellations,
which say nothing about the candidate) and whether its answer was bad (the quality proxy: empty,
or cut at ``max_tokens``; a candidate that has lost its end-of-sequence token rambles to the
limit). After each candidate request :meth:`Canary.check` compares the two windows by
:class:`~minserve.server.routes.CanaryCriteria`:

- nothing is decided before the candidate has ``min_samples`` finished requests (and, for the
  ratios, the baseline too): a few slow requests are noise, not evidence;
- failure rate: the candidate's share of failed requests above ``max_failure_rate``;
- latency: candidate p90 TTFT, p50 TPOT, p90 E2E over the baseline's, above the ratios;
- quality proxy: the candidate's bad-answer rate minus the baseline's above
  ``max_bad_answer_increase`` (same traffic mix, so the difference is the candidate's doing).

The first breach rolls back: the share goes to 0 at once (requests already running finish),
the state becomes ``rolled_back``, and the evidence (every figure compared, both windows'
sizes, the criteria) is kept in :attr:`Canary.decisions`, logged, and counted.
States: ``running`` -> ``rolled_back`` | ``stopped`` | ``promoted``; ``start`` runs it again.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import asdict, replace

from minserve.server.routes import CanaryCriteria, CanaryPolicy

log = logging.getLogger("minserve.server")
FAILED = ("model_error", "dependency_failure", "deadline_exceeded")
STATES = ("running", "rolled_back", "stopped", "promoted")


def quantile(values: list[float], q: float) -> float | None:
    """The q-quantile by linear interpolation; None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class RouteWindow:
    """The recent finished requests of one route (counted outcomes of all of them, latencies
    of those that ended ok)."""

    def __init__(self, size: int):
        self.samples: deque = deque(maxlen=size)  # (outcome, bad_answer, ttft, tpot, e2e)
        self.total: dict[str, int] = {}            # every outcome since start, not windowed

    def add(self, record) -> None:
        self.samples.append((record.outcome, record.bad_answer, record.ttft_s, record.tpot_s, record.e2e_s))
        self.total[record.outcome] = self.total.get(record.outcome, 0) + 1

    def judged(self) -> list:
        """Samples that say something about the route: overload and cancellations do not."""
        return [s for s in self.samples if s[0] == "ok" or s[0] in FAILED]

    def summary(self) -> dict:
        judged = self.judged()
        ok = [s for s in judged if s[0] == "ok"]

        def col(i):
            return [s[i] for s in ok if s[i] is not None]

        n = len(judged)
        return {"samples": n, "failures": n - len(ok),
                "failure_rate": (n - len(ok)) / n if n else None,
                "bad_answer_rate": sum(s[1] for s in ok) / len(ok) if ok else None,
                "ttft_p50_s": quantile(col(2), 0.5), "ttft_p90_s": quantile(col(2), 0.9),
                "tpot_p50_s": quantile(col(3), 0.5), "tpot_p90_s": quantile(col(3), 0.9),
                "e2e_p50_s": quantile(col(4), 0.5), "e2e_p90_s": quantile(col(4), 0.9),
                "outcomes": dict(self.total)}


def breaches(c: CanaryCriteria, cand: dict, base: dict) -> list[tuple[str, float, float]]:
    """(criterion, observed, limit) for every criterion the candidate breaks."""
    out = []
    if cand["samples"] < c.min_samples:
        return out
    if c.max_failure_rate is not None and cand["failure_rate"] > c.max_failure_rate:
        out.append(("failure_rate", cand["failure_rate"], c.max_failure_rate))
    if base["samples"] < c.min_samples:
        return out
    for name, key in (("ttft_p90_ratio", "ttft_p90_s"), ("tpot_p50_ratio", "tpot_p50_s"),
                      ("e2e_p90_ratio", "e2e_p90_s")):
        limit = getattr(c, "max_" + name)
        if limit is None or not cand[key] or not base[key]:
            continue
        ratio = cand[key] / base[key]
        if ratio > limit:
            out.append((name, ratio, limit))
    if (c.max_bad_answer_increase is not None and cand["bad_answer_rate"] is not None
            and base["bad_answer_rate"] is not None):
        rise = cand["bad_answer_rate"] - base["bad_answer_rate"]
        if rise > c.max_bad_answer_increase:
            out.append(("bad_answer_increase", rise, c.max_bad_answer_increase))
    return out


class Canary:
    """The state of one canary and its decisions; thread-safe (HTTP loop and admin calls)."""

    def __init__(self, policy: CanaryPolicy, metrics=None):
        self.policy = policy
        self.state = "running"
        self.share = policy.share
        self.decisions: list[dict] = []
        self.metrics = metrics
        self._lock = threading.Lock()
        self._set_share(policy.share)

    def _set_share(self, share: float) -> None:
        self.share = share
        if self.metrics is not None:
            self.metrics.canary_share.labels(self.policy.route).set(share)

    def _decide(self, decision: str, criterion: str, evidence: dict) -> dict:
        entry = {"time": time.time(), "route": self.policy.route, "decision": decision,
                 "criterion": criterion, "evidence": evidence}
        self.decisions.append(entry)
        if self.metrics is not None:
            self.metrics.canary_decisions.labels(self.policy.route, decision, criterion).inc()
        return entry

    def check(self, cand: dict, base: dict) -> dict | None:
        """Roll back if the candidate breaks a criterion; the decision, or None."""
        with self._lock:
            if self.state != "running":
                return None
            found = breaches(self.policy.criteria, cand, base)
            if not found:
                return None
            self.state = "rolled_back"
            self._set_share(0.0)
            evidence = {"breaches": [{"criterion": n, "observed": v, "limit": lim} for n, v, lim in found],
                        "candidate": cand, "baseline": base, "criteria": asdict(self.policy.criteria)}
            entry = self._decide("rollback", found[0][0], evidence)
        log.warning("canary %s rolled back: %s = %.3g over the limit %.3g (%d candidate, %d baseline samples)",
                    self.policy.route, found[0][0], found[0][1], found[0][2], cand["samples"], base["samples"])
        return entry

    def start(self, share: float | None = None, criteria: CanaryCriteria | None = None) -> dict:
        """Run (again) with a new share and criteria, fixed now, before its traffic arrives."""
        with self._lock:
            self.policy = replace(self.policy, share=self.policy.share if share is None else share,
                                  criteria=criteria or self.policy.criteria)
            self.state = "running"
            self._set_share(self.policy.share)
            return self._decide("start", "admin", {"share": self.share,
                                                   "criteria": asdict(self.policy.criteria)})

    def stop(self, decision: str = "stop") -> dict:
        with self._lock:
            self.state = "promoted" if decision == "promote" else "stopped"
            self._set_share(0.0)
            return self._decide(decision, "admin", {})

    def view(self) -> dict:
        with self._lock:
            p = self.policy
            return {"route": p.route, "state": self.state, "share": self.share,
                    "classes": list(p.classes), "tenants": None if p.tenants is None else list(p.tenants),
                    "seed": p.seed, "criteria": asdict(p.criteria), "decisions": list(self.decisions)}
