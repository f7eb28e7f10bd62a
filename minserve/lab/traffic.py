"""Traffic with a face: requests that carry a priority class, a deadline or an API key, and
what each one got back — an answer, a 429 with ``Retry-After``, a 504, or nothing in time.

:func:`~minserve.lab.workload.run_workload` measures latency; over HTTP it sends every request
alike and counts a refusal as a failure. Overload labs need more: *who* sent a request
(``x-priority-class``, ``x-deadline-ms``, ``Authorization``) and *what it got* (the status code,
the error code, the ``Retry-After`` the server suggested). :func:`offer` sends a list of
:class:`Call` s at their planned times, each a streaming ``/v1/completions`` request, while one
figure updates in place (the latency of answered requests, outcomes as they arrive, the server's
running and waiting requests), and returns a :class:`TrafficResult`.

Goodput, the number that matters under load: requests per second that were answered *within
their service-level objective* (:class:`SLO`: TTFT and TPOT bounds), next to raw throughput (all
answered requests per second). A server past its knee still answers at full throughput; what
collapses is the share of answers that arrive in time.

Outcomes (``TrafficResult.requests.outcome``):

- ``ok``: answered in full (HTTP 200, stream ended normally);
- ``shed``: refused at admission (HTTP 429, with ``Retry-After``; 503 while the server drains);
- ``expired``: admitted, but still queued when its deadline passed (HTTP 504
  ``deadline_exceeded``; for a stream, an error event carrying that code);
- ``gave up``: the client stopped waiting after ``patience_s`` (a user closing the tab);
- ``error``: anything else (the message is in ``error``).

An answered request's ``ttft_s``, ``tpot_s`` and ``e2e_s`` are the bench client's, from the same
stream fold (:mod:`minserve.bench.client`, definitions in :mod:`minserve.metrics.latency`): TTFT
to the first chunk carrying output, E2E to the last chunk carrying choices (not the stream's
close, which follows the usage chunk), TPOT = (E2E - TTFT) / (output tokens - 1). For the other
outcomes ``e2e_s`` is how long the client waited for what it got.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from minserve.lab.hygiene import LoadProbe

OUTCOMES = ("ok", "shed", "expired", "gave up", "error")
OUTCOME_COLORS = {"ok": "tab:green", "shed": "tab:orange", "expired": "tab:red",
                  "gave up": "tab:gray", "error": "black"}
COLUMNS = ["label", "priority_class", "send_s", "status", "outcome", "error_code", "retry_after_s",
           "ttft_s", "tpot_s", "e2e_s", "finish_s", "prompt_tokens", "output_tokens", "deadline_ms",
           "error"]


@dataclass
class Call:
    """One request to send: ``send_s`` seconds after the run starts, ``max_tokens`` output tokens
    (``ignore_eos``: exactly that many), with optional ``priority_class`` (header
    ``x-priority-class``), ``deadline_ms`` (header ``x-deadline-ms``) and ``api_key``
    (``Authorization: Bearer``). ``label`` names it in tables and plots."""

    prompt: str
    max_tokens: int
    send_s: float = 0.0
    label: str = ""
    priority_class: str | None = None
    deadline_ms: float | None = None
    api_key: str | None = None
    prompt_tokens: int = 0

    def headers(self) -> dict[str, str]:
        h = {}
        if self.priority_class is not None:
            h["x-priority-class"] = self.priority_class
        if self.deadline_ms is not None:
            h["x-deadline-ms"] = f"{self.deadline_ms:g}"
        if self.api_key is not None:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


def calls(requests: Sequence, *, request_rate: float = math.inf, burstiness: float = 1.0,
          seed: int = 0, start_s: float = 0.0, **attrs) -> list[Call]:
    """:class:`Call` s for ``requests`` (SampleRequests, e.g. from :func:`make_requests`) sent
    at ``request_rate`` req/s (the bench client's arrival process: Poisson for burstiness 1,
    ``inf`` = all at once) from ``start_s``; ``attrs`` set the other Call fields for all
    (``label``, ``priority_class``, ``deadline_ms``, ``api_key``)."""
    from minserve.bench.arrivals import arrival_times
    times = arrival_times(len(requests), request_rate, burstiness, seed)
    out = []
    for r, t in zip(requests, times):
        label = attrs.get("label", r.scenario or r.request_id)
        out.append(Call(prompt=r.prompt, max_tokens=r.expected_output_len, send_s=start_s + float(t),
                        prompt_tokens=r.prompt_len, **{**attrs, "label": label}))
    return out


def merge(*groups: Iterable[Call]) -> list[Call]:
    """Several groups of calls as one schedule, in send order (stable for equal times)."""
    return sorted((c for g in groups for c in g), key=lambda c: c.send_s)


@dataclass(frozen=True)
class SLO:
    """A service-level objective per request: TTFT at most ``ttft_ms`` and TPOT at most
    ``tpot_ms`` (None: no bound). A shed, expired or abandoned request never meets it."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met(self, frame) -> "Any":
        """Boolean Series: which rows of a requests frame met the objective."""
        ok = frame.outcome == "ok"
        if self.ttft_ms is not None:
            ok &= frame.ttft_s * 1000 <= self.ttft_ms
        if self.tpot_ms is not None:
            ok &= frame.tpot_s.fillna(0) * 1000 <= self.tpot_ms  # one-token answers have no TPOT
        return ok

    def __str__(self) -> str:
        parts = [f"TTFT <= {self.ttft_ms:.0f} ms" if self.ttft_ms is not None else "",
                 f"TPOT <= {self.tpot_ms:.0f} ms" if self.tpot_ms is not None else ""]
        return " and ".join(p for p in parts if p) or "no bound"


@dataclass
class TrafficResult:
    """What one :func:`offer` left behind: ``requests`` (one row per call, :data:`COLUMNS`, times
    in seconds since the run started), ``state`` (the server's running / waiting requests over
    time, from ``/metrics``), ``duration_s`` (first send to last response) and the figure."""

    name: str
    requests: "Any"
    state: "Any"
    duration_s: float
    settings: dict = field(default_factory=dict)
    figure: Any = None
    load: Any = None    # a minserve.lab.hygiene.Load: other processes' CPU use during the run

    def counts(self, by: str = "label") -> "Any":
        """Requests by ``by`` (label or priority_class) and outcome (a DataFrame of counts)."""
        import pandas as pd
        t = pd.crosstab(self.requests[by], self.requests.outcome)
        return t.reindex(columns=[o for o in OUTCOMES if o in t.columns], fill_value=0)

    def goodput(self, slo: SLO, label: str | None = None) -> dict[str, float]:
        """Offered, answered, shed and good requests (of ``label``, or all), and the rates:
        ``throughput_rps`` (answered / duration), ``goodput_rps`` (met the SLO / duration)."""
        df = self.requests if label is None else self.requests[self.requests.label == label]
        good = int(slo.met(df).sum())
        ok = int((df.outcome == "ok").sum())
        d = self.duration_s
        return {"offered": int(len(df)), "answered": ok,
                "shed": int(df.outcome.isin(["shed", "expired"]).sum()),
                "good": good, "throughput_rps": ok / d if d > 0 else math.nan,
                "goodput_rps": good / d if d > 0 else math.nan}

    def show(self) -> None:
        """Display the run's final figure in a notebook, as a PNG: the figure is a pyplot-free
        one, which IPython only renders by itself once pyplot has drawn something."""
        if self.figure is None:
            return
        from IPython.display import Image, display

        from minserve.lab.live import figure_png
        display(Image(data=figure_png(self.figure), format="png"))

    def percentiles(self, metric: str = "ttft_s", by: str = "label", q=(50, 90, 99)) -> "Any":
        """Percentiles (ms) of ``metric`` over the answered requests, one row per ``by`` value."""
        import pandas as pd
        ok = self.requests[self.requests.outcome == "ok"]
        rows = {}
        for key, part in ok.groupby(by):
            v = part[metric].dropna().to_numpy(float) * 1000
            rows[key] = {f"p{p:g}": float(np.percentile(v, p)) if len(v) else math.nan for p in q}
            rows[key]["answered"] = len(v)
        return pd.DataFrame(rows).T

    def __repr__(self) -> str:
        c = self.requests.outcome.value_counts().to_dict()
        parts = ", ".join(f"{n} {o}" for o, n in c.items())
        return (f"TrafficResult({self.name!r}: {len(self.requests)} requests: {parts}; "
                f"{self.duration_s:.1f} s)")


# ---- sending ----------------------------------------------------------------------------------

@dataclass
class _Record:
    call: Call
    send_s: float = math.nan
    status: int = 0
    outcome: str = "error"
    error_code: str | None = None
    retry_after_s: float = math.nan
    ttft_s: float = math.nan
    tpot_s: float = math.nan
    e2e_s: float = math.nan
    output_tokens: int = 0
    error: str = ""

    @property
    def finish_s(self) -> float:
        return self.send_s + self.e2e_s


def _answered(rec: _Record, stream) -> None:
    """Fill an answered request's latencies from its stream, as the bench client does (same
    emissions, TTFT, E2E to the last chunk carrying choices, TPOT; definitions in
    :mod:`minserve.bench.metrics` and :mod:`minserve.metrics.latency`)."""
    from minserve.bench.metrics import output_len, request_tpot
    stream.finish()
    bench = stream.rec
    if not bench.success:  # a 200 whose stream never carried a completion chunk
        rec.error = bench.error
        return
    n = output_len(bench)
    tpot = request_tpot(bench, n)
    rec.outcome, rec.output_tokens = "ok", n
    rec.ttft_s, rec.e2e_s = bench.ttft, bench.latency
    rec.tpot_s = math.nan if tpot is None else tpot


async def _send(client, url: str, model: str, call: Call, t0: float, patience_s: float | None) -> _Record:
    import json

    from minserve.bench.client import SSEReader, _Stream
    from minserve.bench.metrics import RequestRecord

    rec = _Record(call)
    payload = {"model": model, "prompt": call.prompt, "max_tokens": call.max_tokens,
               "temperature": 0.0, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    rec.send_s = start - t0

    def since_start() -> float:
        return time.perf_counter() - start

    async def talk():
        async with client.stream("POST", url, json=payload, headers=call.headers()) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                rec.e2e_s = since_start()
                try:
                    err = json.loads(body).get("error") or {}
                except ValueError:
                    err = {}
                rec.error_code, rec.error = err.get("code"), err.get("message") or body[:300]
                if resp.headers.get("retry-after"):
                    rec.retry_after_s = float(resp.headers["retry-after"])
                rec.outcome = ("shed" if resp.status_code in (429, 503) else
                               "expired" if resp.status_code == 504 else "error")
                return
            # The bench client's reader and fold; only an error event is read here first, for
            # its code (the bench client just fails the request).
            reader, stream = SSEReader(), _Stream(RequestRecord(start_time=start), chat=False)

            def on_event(event: str) -> bool:
                now = time.perf_counter()
                if event.strip() != "[DONE]":
                    err = json.loads(event).get("error")
                    if err:
                        rec.error_code, rec.error = err.get("code"), err.get("message", "")
                        rec.outcome = "expired" if rec.error_code == "deadline_exceeded" else "error"
                        rec.status = 504 if rec.outcome == "expired" else 500
                        rec.e2e_s = now - start
                        return False
                stream.on_event(event, now)
                return True

            async for line in resp.aiter_lines():
                event = reader.feed(line)
                if event is not None and not on_event(event):
                    return
            tail = reader.flush()  # a server may close without the final blank line
            if tail is not None and not on_event(tail):
                return
            rec.e2e_s = since_start()  # replaced by the E2E of the answer, if there is one
            _answered(rec, stream)

    try:
        if patience_s is None:
            await talk()
        else:
            await asyncio.wait_for(talk(), patience_s)
    except asyncio.TimeoutError:
        rec.outcome, rec.e2e_s = "gave up", since_start()
        rec.error = f"no complete answer within the client's patience of {patience_s:g} s"
    except Exception as e:  # noqa: BLE001 - every failure becomes a record, never a crash
        rec.outcome, rec.e2e_s = "error", since_start()
        rec.error = f"{type(e).__name__}: {e}"
    return rec


async def _main(base_url, calls_, model, patience_s, records, pollers, metrics_api_key,
                max_concurrency=None):
    import httpx

    from minserve.bench.server_metrics import MetricsPoller

    key = next((c.api_key for c in calls_ if c.api_key), None) or metrics_api_key
    model_id = model or await _first_model(base_url, key)
    url = f"{base_url}/v1/completions"
    # No connection limit: a pool cap would queue requests in the client and hide the server's
    # own queueing (and its refusals) behind it.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    mh = {"Authorization": f"Bearer {metrics_api_key}"} if metrics_api_key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits) as client, \
            httpx.AsyncClient(timeout=5.0, headers=mh) as metrics_client:
        t0 = time.perf_counter()
        poller = MetricsPoller(metrics_client, f"{base_url}/metrics", 0.25, t0)
        pollers.append(poller)
        poller.start()

        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def one(c: Call):
            if gate is None:
                rec = await _send(client, url, model_id, c, t0, patience_s)
            else:
                async with gate:
                    rec = await _send(client, url, model_id, c, t0, patience_s)
            records.append(rec)
            return rec

        tasks = []
        try:
            for c in sorted(calls_, key=lambda c: c.send_s):
                delay = t0 + c.send_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(c)))
            out = await asyncio.gather(*tasks)
        finally:
            await poller.stop()
    return out, poller.frame(), model_id


async def _first_model(base_url: str, api_key: str | None) -> str:
    """The first model ``/v1/models`` lists, asked with ``api_key`` (a server with keys wants one)
    or, without it, as the bench client asks (``$OPENAI_API_KEY``)."""
    import httpx

    from minserve.bench.client import auth_headers
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else auth_headers()
    try:
        async with httpx.AsyncClient(timeout=30, headers=headers) as client:
            r = await client.get(f"{base_url}/v1/models")
            r.raise_for_status()
            return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise ValueError(f"could not list models at {base_url}/v1/models ({type(e).__name__}: {e}); "
                         "is the server up, and is the API key right?") from e


def offer(base_url: str, calls_: Sequence[Call], *, name: str = "traffic", slo: SLO | None = None,
          patience_s: float | None = None, max_concurrency: int | None = None,
          model: str | None = None, live: bool = True, interval_s: float | None = None,
          metrics_api_key: str | None = None) -> TrafficResult:
    """Send ``calls_`` to the server at ``base_url`` at their ``send_s`` times (streaming
    ``/v1/completions``); returns a :class:`TrafficResult`. ``slo``: drawn on the live figure
    (and kept in ``settings``). ``patience_s``: a client gives up on a request not finished by
    then. ``max_concurrency``: at most this many requests in flight (the client waits for a free
    slot, as the bench client does; None: no limit). ``live``: the figure and progress line
    update while it runs (the final frame stays).
    ``metrics_api_key``: sent with the ``/metrics`` polls (a server with keys needs an admin key).
    """
    import dataclasses

    import pandas as pd

    from minserve.lab.target import key_for
    calls_ = list(calls_)
    if not calls_:
        raise ValueError("calls_ is empty; build some with traffic.calls(make_requests(...), ...)")
    base_url = base_url.rstrip("/")
    lab_key = key_for(base_url)   # the lab target's server: its key on calls that carry none
    if lab_key:
        calls_ = [c if c.api_key else dataclasses.replace(c, api_key=lab_key) for c in calls_]
        metrics_api_key = metrics_api_key or lab_key
    view = LiveTraffic(len(calls_), name, slo, interval_s=interval_s, enabled=live)
    box: dict[str, Any] = {}
    records: list[_Record] = []
    pollers: list = []

    def work():
        try:
            box["out"] = asyncio.run(_main(base_url, calls_, model, patience_s, records, pollers,
                                           metrics_api_key, max_concurrency))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=work, name="minserve-lab-traffic", daemon=True)
    probe = LoadProbe().start()
    view.start()
    thread.start()
    while thread.is_alive():
        thread.join(timeout=view.interval_s / 2)
        view.tick(records, pollers[0].samples if pollers else [])
    if "error" in box:
        view.finish(None)
        raise box["error"]
    recs, state, model_id = box["out"]
    df = _frame(recs)
    state = pd.DataFrame({"t_s": state.t, "num_running": state.num_requests_running,
                          "num_waiting": state.num_requests_waiting})
    ends = df.finish_s.dropna()
    duration = float(max(ends.max() if len(ends) else 0.0, df.send_s.max()))
    result = TrafficResult(name, df, state, duration,
                           settings={"base_url": base_url, "model": model_id, "slo": slo,
                                     "patience_s": patience_s, "max_concurrency": max_concurrency,
                                     "num_calls": len(calls_)}, load=probe.stop())
    result.figure = view.finish(result)
    return result


def _frame(recs: list[_Record]) -> "Any":
    import pandas as pd
    rows = []
    for r in recs:
        c = r.call
        rows.append({"label": c.label, "priority_class": c.priority_class or "interactive",
                     "send_s": r.send_s, "status": r.status, "outcome": r.outcome,
                     "error_code": r.error_code, "retry_after_s": r.retry_after_s,
                     "ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "e2e_s": r.e2e_s, "finish_s": r.finish_s,
                     "prompt_tokens": c.prompt_tokens, "output_tokens": r.output_tokens,
                     "deadline_ms": c.deadline_ms, "error": r.error})
    return pd.DataFrame(rows, columns=COLUMNS)


# ---- the live view ----------------------------------------------------------------------------

class LiveTraffic:
    """Three panels updated in place: TTFT of answered requests by send time (with the SLO),
    outcomes by send time, the server's running and waiting requests. Same display rules as
    :class:`~minserve.lab.live.LiveRun` (one display handle, PNG frames, final frame kept, only
    the final frame under CI)."""

    def __init__(self, total: int, title: str, slo: SLO | None = None,
                 interval_s: float | None = None, enabled: bool = True):
        from minserve.lab.live import in_notebook
        from minserve.lab.presets import get_preset, is_ci
        self.total, self.title, self.slo = total, title, slo
        self.interval_s = interval_s if interval_s is not None else get_preset().live_interval_s
        self.enabled = enabled and in_notebook()
        self.frames = self.enabled and not is_ci()
        self._fig = self._fig_handle = self._bar_handle = None
        self._t0 = self._last = self._gap_s = 0.0

    def start(self) -> None:
        self._t0 = self._last = time.perf_counter()
        if self.enabled:
            from minserve.lab.live import _Progress, show
            self._bar_handle = show(_Progress(0, self.total, 0.0, self.title), "progress")

    def _bar(self, done: int):
        from minserve.lab.live import _Progress
        return _Progress(done, self.total, time.perf_counter() - self._t0, self.title)

    def tick(self, records: list, samples: list) -> None:
        if not self.enabled:
            return
        self._bar_handle.update(self._bar(len(records)))
        now = time.perf_counter()
        # A frame is drawn in this process, where the server and its engine run too: keep frames
        # at least 8 drawing times apart, so the live view takes at most ~1/8 of the CPU.
        if self.frames and now - self._last >= max(self.interval_s, self._gap_s):
            df = _frame(list(records))
            st = {"t_s": [s["t"] for s in samples],
                  "num_running": [s["num_requests_running"] for s in samples],
                  "num_waiting": [s["num_requests_waiting"] for s in samples]}
            self._draw(df, st, f"{self.title} (running...)")
            self._last = time.perf_counter()
            self._gap_s = 8 * (self._last - now)

    def _figure(self):
        from minserve.lab.live import new_figure
        if self._fig is None:
            self._fig = new_figure(3)
        return self._fig

    def _draw(self, df, st, title: str) -> None:
        fig = self._figure()
        draw_traffic(fig, df, st, self.slo, title)
        if self.enabled:
            from IPython.display import Image

            from minserve.lab.live import figure_png, show
            img = Image(data=figure_png(fig), format="png")
            if self._fig_handle is None:
                self._fig_handle = show(img, "figure")
            else:
                self._fig_handle.update(img)

    def finish(self, result: TrafficResult | None):
        if result is None:
            return None
        if self.enabled:
            self._bar_handle.update(self._bar(len(result.requests)))
        st = {k: result.state[k].to_numpy(float) for k in ("t_s", "num_running", "num_waiting")}
        n_ok = int((result.requests.outcome == "ok").sum())
        self._draw(result.requests, st, f"{self.title}: {n_ok}/{len(result.requests)} answered "
                   f"in {result.duration_s:.1f} s")
        return self._fig


def draw_traffic(fig, df, state, slo: SLO | None, title: str) -> None:
    """The three panels of :class:`LiveTraffic` on ``fig`` (a figure with three axes)."""
    ax1, ax2, ax3 = fig.axes
    for ax in fig.axes:
        ax.cla()
    ok = df[df.outcome == "ok"]
    labels = list(dict.fromkeys(df.label))
    markers = "o^sDv"
    for k, lab in enumerate(labels[:5]):
        part = ok[ok.label == lab]
        if len(part):
            ax1.scatter(part.send_s, part.ttft_s * 1000, s=14, marker=markers[k], label=str(lab))
    if slo is not None and slo.ttft_ms is not None:
        ax1.axhline(slo.ttft_ms, color="tab:red", ls="--", lw=1, label="TTFT objective")
    ax1.set_ylim(bottom=0)
    ax1.set_xlabel("sent at (s)")
    ax1.set_ylabel("TTFT (ms)")
    ax1.set_title("TTFT of answered requests")
    if ax1.get_legend_handles_labels()[0]:
        ax1.legend(loc="upper left", fontsize=8)
    ys = {lab: k for k, lab in enumerate(labels)}
    for outcome in OUTCOMES:
        part = df[df.outcome == outcome]
        if len(part):
            ax2.scatter(part.send_s, [ys[x] for x in part.label], s=22,
                        marker="|" if outcome == "ok" else "x", color=OUTCOME_COLORS[outcome],
                        label=f"{outcome} ({len(part)})")
    ax2.set_yticks(range(len(labels)))
    ax2.set_yticklabels([str(x) for x in labels])
    ax2.set_ylim(-0.6, max(len(labels), 1) - 0.4)
    ax2.set_xlabel("sent at (s)")
    ax2.set_title("what each request got")
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend(loc="upper right", fontsize=8)
    t = np.asarray(state["t_s"], float)
    if len(t):
        ax3.step(t, np.asarray(state["num_running"], float), where="post", color="tab:green",
                 label="running")
        ax3.step(t, np.asarray(state["num_waiting"], float), where="post", color="tab:red",
                 label="waiting (engine queue)")
        ax3.legend(loc="upper right", fontsize=8)
    ax3.set_xlabel("time (s)")
    ax3.set_ylabel("requests")
    ax3.set_title("server: running and waiting")
    xmax = max([1e-3, *(df.send_s.dropna().tolist()), *(t.tolist() if len(t) else [])]) * 1.03
    for ax in (ax1, ax2, ax3):
        ax.set_xlim(0, xmax)
    fig.suptitle(title, fontsize=11)


def experiment(preset=None, *, base_url: str, num_requests: int = 16, request_rate: float = 4.0,
               max_concurrency: int | None = None, prompt_tokens: int = 32, output_tokens: int = 8,
               priority_class: str | None = None, deadline_ms: float | None = None,
               slo: SLO | None = None, patience_s: float | None = None, seed: int = 0,
               live: bool = True, name: str | None = None) -> TrafficResult:
    """One load test against ``base_url``: ``num_requests`` prompts of ``prompt_tokens`` tokens
    asking for ``output_tokens`` each, Poisson arrivals at ``request_rate`` req/s (``inf``: all at
    once), every one with the same ``priority_class`` and ``deadline_ms`` (None: not sent). The
    function the overload lab's control panel calls (its sliders name the same arguments)."""
    from minserve.lab.presets import get_preset
    from minserve.lab.workload import make_requests
    preset = preset or get_preset()
    tok = _tokenizer(preset.model)
    reqs = make_requests(tok, prompt_tokens, output_tokens, num_requests, seed=seed)
    rate = "all at once" if math.isinf(request_rate) else f"{request_rate:.3g} req/s"
    label = name or f"{num_requests} requests at {rate}"
    cs = calls(reqs, request_rate=request_rate, seed=seed, label=priority_class or "requests",
               priority_class=priority_class, deadline_ms=deadline_ms)
    return offer(base_url, cs, name=label, slo=slo, patience_s=patience_s,
                 max_concurrency=max_concurrency, live=live)


def _tokenizer(model: str):
    """The model's tokenizer (the loader keeps one per folder and process)."""
    from minserve.models.loader import load_tokenizer, resolve_model_dir
    return load_tokenizer(resolve_model_dir(model))
