"""Lab 08's failure drills, against a server started in the notebook: a traffic burst (is the
overload observable, and how long until requests meet their objective again?) and a server
restart in the middle of steady traffic (what clients saw, how long the service was gone, how
many requests were lost and how many a retry saved)."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

import httpx
import pandas as pd

from minserve.lab import traffic as tr
from course.lab08_measure import met


def class_calls(requests, *, rate: float, seed: int, start_s: float = 0.0, **attrs) -> list:
    """Calls for workload requests, each labelled with its class (the request's ``scenario``)."""
    return tr.calls(requests, request_rate=rate, seed=seed, start_s=start_s, **attrs)


# ---- the burst ----------------------------------------------------------------------------------

@dataclass
class BurstReport:
    burst_at_s: float
    detected_after_s: float      # first /metrics sample with more waiting than before the burst
    peak_waiting: int
    late_after_burst: int        # requests sent after the burst that missed their SLO
    recovered_after_s: float     # from the burst until every later request met its SLO (inf: never)
    frame: pd.DataFrame = field(repr=False, default=None)


def burst_report(res, slos: dict, burst_at_s: float) -> BurstReport:
    """Read a burst run: ``res`` is the TrafficResult, the burst's calls were sent at
    ``burst_at_s`` (the steady calls around it carry their class label)."""
    st = res.state
    before = st[st.t_s < burst_at_s].num_waiting
    base = int(before.max()) if len(before) else 0
    after = st[(st.t_s >= burst_at_s) & (st.num_waiting > base)]
    detected = float(after.t_s.min() - burst_at_s) if len(after) else math.inf
    df = res.requests.sort_values("send_s").reset_index(drop=True)
    df["good"] = met(df, slos).to_numpy()
    later = df[df.send_s >= burst_at_s]
    bad = later[~later.good]
    recovered = math.inf
    if len(later) and later.good.iloc[-1]:
        last_bad = bad.send_s.max() if len(bad) else burst_at_s
        nxt = later[later.send_s > last_bad].send_s
        recovered = float(nxt.min() - burst_at_s) if len(bad) else 0.0
    return BurstReport(burst_at_s, detected, int(st.num_waiting.max()) if len(st) else 0, len(bad),
                       recovered, df)


# ---- the restart ------------------------------------------------------------------------------

@dataclass
class RestartReport:
    stopped_at_s: float
    back_after_s: float          # from the stop until /health answered 200 again
    outcomes: pd.DataFrame       # what the clients saw, by status
    lost: int                    # requests that got no answer
    retried_ok: int              # of those, answered when sent again after the restart
    server: object = field(repr=False, default=None)   # the new server


def _wait_healthy(base_url: str, timeout_s: float = 30.0) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        try:
            if httpx.get(f"{base_url}/health", timeout=1.0).status_code == 200:
                return time.perf_counter()
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    return math.inf


def restart_drill(srv, calls, *, restart_at_s: float, down_s: float, slo=None) -> RestartReport:
    """Send ``calls`` to ``srv`` and restart it ``restart_at_s`` seconds in (down ``down_s``);
    then send the requests that got no answer once more. The server keeps its port, so clients
    need no new address, as behind a stable service name."""
    box: dict = {}
    t0 = time.perf_counter()

    def restart():
        time.sleep(restart_at_s)
        box["stop"] = time.perf_counter()
        box["server"] = srv.restart(down_s)
        box["back"] = _wait_healthy(box["server"].base_url)

    th = threading.Thread(target=restart, name="lab08-restart", daemon=True)
    th.start()
    # The model named up front: asked of the server, the question could meet it already down on a
    # busy machine (the restart's clock starts first), and the whole run would fail, not its calls.
    res = tr.offer(srv.base_url, calls, name="steady traffic, server restarted", slo=slo, live=False,
                   model=srv.model_name)
    th.join()
    df = res.requests
    seen = df.assign(status=df.status.fillna(0).astype(int)).groupby(["status", "outcome"]).size()
    lost = df[df.outcome != "ok"]
    retried_ok = 0
    if len(lost):
        again = [c for c, o in zip(calls, df.outcome) if o != "ok"]
        again = [tr.Call(c.prompt, c.max_tokens, 0.0, c.label, c.priority_class) for c in again]
        retry = tr.offer(box["server"].base_url, again, name="the lost requests, sent again", live=False)
        retried_ok = int((retry.requests.outcome == "ok").sum())
    return RestartReport(box["stop"] - t0, box["back"] - box["stop"], seen.rename("requests").reset_index(),
                         len(lost), retried_ok, box["server"])




# ---- capacity removal -----------------------------------------------------------------------

@dataclass
class RemovalReport:
    removed_at_s: float
    outcomes: pd.DataFrame       # per replica: requests by outcome
    failed_over: int             # calls routed to the removed replica that got no answer
    failover_ok: int             # of those, answered by the replica left
    frames: dict = field(repr=False, default_factory=dict)


def removal_drill(kept, removed, calls, *, remove_at_s: float) -> RemovalReport:
    """Two replicas behind a client-side round-robin balancer with no health checks (call k goes
    to replica k % 2); ``removed`` is stopped ``remove_at_s`` seconds in, so the calls routed to
    it from then on fail, and the balancer then sends them to ``kept`` (failover)."""
    box: dict = {}
    # Both replicas serve one model, named up front rather than asked of B: on a busy machine that
    # question could reach B after it was stopped, and B's whole run would fail instead of its calls
    # (`make test` beside another job, 2026-12-06: KeyError 'removed', the thread's ConnectError).
    model = removed.model_name

    def other():
        box["removed"] = tr.offer(removed.base_url, calls[1::2], name="replica B", live=False, model=model)

    def remove():
        time.sleep(remove_at_s)
        removed.stop()

    threads = [threading.Thread(target=f, daemon=True) for f in (other, remove)]
    for t in threads:
        t.start()
    first = tr.offer(kept.base_url, calls[0::2], name="replica A", live=False, model=model)
    for t in threads:
        t.join()
    b = box["removed"].requests
    lost = [c for c, o in zip(calls[1::2], b.outcome) if o != "ok"]
    ok = 0
    if lost:
        again = [tr.Call(c.prompt, c.max_tokens, 0.0, c.label, c.priority_class) for c in lost]
        ok = int((tr.offer(kept.base_url, again, name="failover to A", live=False).requests.outcome == "ok").sum())
    outcomes = pd.DataFrame({"A (kept)": first.requests.outcome.value_counts(),
                             "B (removed)": b.outcome.value_counts()}).fillna(0).astype(int)
    return RemovalReport(remove_at_s, outcomes, len(lost), ok, {"A": first.requests, "B": b})
