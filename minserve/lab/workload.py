"""Run a workload against an engine in this process, or a server over HTTP, and keep the records.

One function, :func:`run_workload`, serves both targets so a lab cell works either way:

- an in-process engine (an ``LLM`` or ``LLMEngine``): requests are offered by
  :func:`minserve.bench.inprocess.run_inprocess` (same arrival process and metrics as the HTTP
  client), and the result carries the engine's own records — per-request timelines (queue,
  prefill, first token, preemptions), per-step records (batch, KV usage, prefill chunks);
- ``base_url=`` of an OpenAI-compatible server (a shared ``minserve serve``, or vLLM): requests go
  through :mod:`minserve.bench.client` and the server's ``/metrics`` is polled with
  :class:`~minserve.bench.server_metrics.MetricsPoller`. Only client-side times exist then (TTFT,
  TPOT, E2E) plus the server's gauges; helpers that need engine records say so
  (:class:`EngineRecordsRequired`).

Either way one figure updates in place while the run goes (see :mod:`minserve.lab.live`), and the
result has the same frames: ``requests`` (one row per request, seconds since the run started) and
``state`` (running / waiting requests, KV usage, preemptions over time).

Prompts of an exact token length (:func:`make_requests`) are cut from real text (the standard
library's documentation, :mod:`minserve.bench.corpus`), so nothing is downloaded.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from minserve.bench.datasets import SampleRequest
from minserve.lab.hygiene import LoadProbe

if TYPE_CHECKING:
    import pandas as pd

REQUEST_COLUMNS = [
    "request_id", "label", "prompt_tokens", "output_tokens", "cached_tokens", "num_preemptions",
    "arrival_s", "first_scheduled_s", "first_token_s", "finished_s",
    "queue_s", "ttft_s", "prefill_s", "decode_s", "tpot_s", "e2e_s", "itl_max_s", "success",
    "engine_id", "token_times_s",
]
STATE_COLUMNS = ["t_s", "num_running", "num_waiting", "kv_cache_usage", "num_preemptions"]


class EngineRecordsRequired(RuntimeError):
    """Raised by helpers that need the engine's own records when the run went over HTTP."""

    def __init__(self, what: str):
        super().__init__(
            f"{what} needs the engine's own records (request timelines and step records), which "
            "only an in-process run has; over HTTP a client sees send, first-token and finish "
            "times and the server's /metrics gauges. Run the workload on an engine in this "
            "notebook (run_workload(llm, ...)) to see it.")


# ---- prompts ---------------------------------------------------------------------------------

_corpora: dict[int, tuple[Any, Any]] = {}  # id(tokenizer) -> (tokenizer, its Corpus)


def _corpus(tokenizer):
    """The documentation corpus cut with ``tokenizer`` (built once per tokenizer, ~0.5 s). The
    tokenizer is kept with it, so its id cannot be reused by another one while cached."""
    from minserve.bench.corpus import Corpus
    entry = _corpora.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:
        entry = _corpora[id(tokenizer)] = (tokenizer, Corpus(tokenizer))
    return entry[1]


def text_of_length(tokenizer, n_tokens: int, seed: int = 0, prefix: str = "") -> str:
    """``prefix`` followed by documentation text, ``n_tokens`` tokens in all as a prompt
    (special tokens included, as a server counts them). Within a token or two when a BPE merge
    across the cut makes the exact count impossible."""
    corpus = _corpus(tokenizer)
    rng = np.random.default_rng(seed)
    base = corpus.count(prefix) if prefix else corpus.count("")
    want = n_tokens - base
    if want <= 0:
        return prefix
    start = corpus.passage(rng, want + 8)
    best = prefix + corpus.cut(start, want)
    if corpus.count(best) == n_tokens:
        return best
    for k in (want, want - 1, want + 1, want - 2, want + 2, want - 3):  # merges at the seam
        if k <= 0:
            continue
        text = prefix + corpus.cut(start, k)
        got = corpus.count(text)
        if got == n_tokens:
            return text
        if abs(got - n_tokens) < abs(corpus.count(best) - n_tokens):
            best = text
    return best


def make_requests(tokenizer, prompt_tokens: int | Sequence[int], output_tokens: int | Sequence[int],
                  num_requests: int | None = None, labels: Sequence[str] | None = None,
                  seed: int = 0, prefixes: Sequence[str] | None = None) -> list[SampleRequest]:
    """Requests with the given prompt and output lengths (tokens).

    ``prompt_tokens`` / ``output_tokens``: one value for all, or one per request.
    ``num_requests`` defaults to the length of the longest list given. ``labels`` name the
    requests in tables and plots (default: the prompt length, e.g. ``"512 tok"``). ``prefixes``:
    text each prompt starts with (e.g. a question), the rest is filler up to the length.
    """
    lists = [x for x in (prompt_tokens, output_tokens, labels, prefixes) if isinstance(x, (list, tuple))]
    n = num_requests if num_requests is not None else max((len(x) for x in lists), default=1)
    if n < 1:
        raise ValueError(f"num_requests must be >= 1, got {n}")

    def each(x, name):
        if isinstance(x, (list, tuple)):
            if len(x) != n:
                raise ValueError(f"{name} has {len(x)} values for {n} requests")
            return list(x)
        return [x] * n

    ps, os_ = each(prompt_tokens, "prompt_tokens"), each(output_tokens, "output_tokens")
    for name, values in (("prompt_tokens", ps), ("output_tokens", os_)):
        bad = [v for v in values if not isinstance(v, (int, np.integer)) or v < 1]
        if bad:
            raise ValueError(f"{name} must be integers >= 1, got {bad[0]!r}")
    labs = each(labels, "labels") if labels is not None else [f"{p} tok" for p in ps]
    pres = each(prefixes, "prefixes") if prefixes is not None else [""] * n
    out = []
    for i in range(n):
        text = text_of_length(tokenizer, int(ps[i]), seed=seed * 100_003 + i, prefix=pres[i])
        out.append(SampleRequest(text, len(tokenizer(text).input_ids), int(os_[i]), str(i), str(labs[i])))
    return out


def scenario_requests(tokenizer, name: str, num_requests: int, seed: int = 0,
                      length_scale: float = 1.0) -> list[SampleRequest]:
    """Requests of a bench scenario (``qa``, ``rag``, ``code``, ``agent`` or ``mix``), labelled by
    scenario; see :mod:`minserve.bench.scenarios`."""
    from minserve.bench.datasets import sample_scenario
    return sample_scenario(tokenizer, name, num_requests, seed, length_scale)


# ---- the result ------------------------------------------------------------------------------

@dataclass
class RunResult:
    """What one workload run left behind.

    ``requests``: one row per request (:data:`REQUEST_COLUMNS`), times in seconds since the run
    started; over HTTP the engine-only columns (queue, prefill, preemptions) are NaN.
    ``state``: the engine's state over time (:data:`STATE_COLUMNS`; ``kv_cache_usage`` is a
    fraction, ``num_preemptions`` cumulative): one row per step in process, one per ``/metrics``
    sample over HTTP. ``steps``: the engine's step records of this run (``t_s`` since the run
    started, ``batch`` = requests computed in the step), None over HTTP. ``timelines``: per
    request, its event lists (admissions, preemptions) and prefill chunks, None over HTTP.
    ``summary``: vLLM's benchmark result keys. ``figure``: the live figure's last frame.
    """

    name: str
    target: str
    requests: "pd.DataFrame"
    state: "pd.DataFrame"
    summary: dict
    duration_s: float
    settings: dict = field(default_factory=dict)
    steps: "pd.DataFrame | None" = None
    timelines: dict | None = None
    bench: Any = None
    figure: Any = None
    load: Any = None    # a minserve.lab.hygiene.Load: other processes' CPU use during the run

    @property
    def in_process(self) -> bool:
        return self.steps is not None

    def require_engine(self, what: str) -> None:
        """Raise :class:`EngineRecordsRequired` unless this run has the engine's records."""
        if not self.in_process:
            raise EngineRecordsRequired(what)

    def by_label(self, label: str) -> "pd.Series":
        """The row of the (first) request with this label."""
        rows = self.requests[self.requests.label == label]
        if rows.empty:
            raise KeyError(f"no request labelled {label!r}; labels: {sorted(self.requests.label.unique())}")
        return rows.iloc[0]

    def percentiles(self, metrics=("ttft_s", "tpot_s", "e2e_s"), q=(50, 90, 99)) -> "pd.DataFrame":
        """Percentiles of the finished requests' latencies, in milliseconds."""
        import pandas as pd
        ok = self.requests[self.requests.success]
        rows = {}
        for m in metrics:
            v = ok[m].dropna().to_numpy() * 1000
            rows[m.replace("_s", " (ms)")] = {f"p{p:g}": (np.percentile(v, p) if len(v) else math.nan)
                                              for p in q}
        return pd.DataFrame(rows).T

    def key_numbers(self) -> dict[str, float]:
        """The numbers a lab records as its baseline (medians and p90s in ms, throughput)."""
        ok = self.requests[self.requests.success]
        out = {"requests": int(len(self.requests)), "failed": int((~self.requests.success).sum()),
               "duration_s": round(self.duration_s, 3)}
        for m in ("ttft_s", "tpot_s", "e2e_s"):
            v = ok[m].dropna().to_numpy() * 1000
            if len(v):
                out[f"median_{m[:-2]}_ms"] = round(float(np.median(v)), 2)
                out[f"p90_{m[:-2]}_ms"] = round(float(np.percentile(v, 90)), 2)
        out["output_tok_per_s"] = round(float(self.summary.get("output_throughput", math.nan)), 2)
        if self.load is not None and self.load.others_cores is not None:
            out["others_cores"] = round(self.load.others_cores, 2)  # load noted with every result
        return out

    def __repr__(self) -> str:
        ok = int(self.requests.success.sum())
        return (f"RunResult({self.name!r}, {self.target}, {ok}/{len(self.requests)} requests ok, "
                f"{self.duration_s:.1f} s)")


def run_sweep(values: Sequence, run_one, title: str = "sweep", live: bool = True) -> dict:
    """``{value: run_one(value)}`` for each value, with one progress line for the whole sweep
    (``run_one`` should call :func:`run_workload` with ``live=False``: one figure per point of a
    sweep would bury the notebook; plot the sweep's summary instead)."""
    from minserve.lab.live import Progress
    values = list(values)
    bar = Progress(len(values), title, "runs", enabled=live)
    out = {}
    for k, v in enumerate(values):
        bar.update(k, f"now: {v}")
        out[v] = run_one(v)
    bar.update(len(values))
    return out


# ---- running ----------------------------------------------------------------------------------

def _engine_of(target):
    eng = getattr(target, "llm_engine", target)
    if not hasattr(eng, "step") or not hasattr(eng, "add_request"):
        raise ValueError(f"target must be an LLM or an LLMEngine (or pass base_url=), got "
                         f"{type(target).__name__}")
    return eng


def run_workload(target=None, requests: Sequence[SampleRequest] = (), *, base_url: str | None = None,
                 request_rate: float = math.inf, max_concurrency: int | None = None,
                 burstiness: float = 1.0, seed: int = 0, ignore_eos: bool = True,
                 live: bool = True, name: str = "run", title: str | None = None,
                 interval_s: float | None = None, model: str | None = None,
                 chat: bool = False) -> RunResult:
    """Offer ``requests`` at ``request_rate`` req/s (``inf``: all at once), at most
    ``max_concurrency`` in flight, to an in-process engine (``target``: an ``LLM`` or
    ``LLMEngine``) or to the server at ``base_url`` (``model``: its model id, default the first
    it lists; ``chat``: use /v1/chat/completions). ``ignore_eos`` (default on, as for vLLM's
    synthetic workloads) makes every request produce exactly its ``expected_output_len`` tokens.
    ``live``: show the live figure and progress while it runs.

    ``target`` may also be what :func:`~minserve.lab.session.engine_for` returns when the lab's
    target is a server (:class:`~minserve.lab.target.RemoteLLM`): the run then goes to that
    server. Requests to the lab target's server carry its API key (``$MINSERVE_LAB_API_KEY``);
    to any other server, ``$OPENAI_API_KEY`` when set, as ``vllm bench serve`` sends it.
    """
    from minserve.lab.live import LiveRun
    from minserve.lab.target import RemoteLLM
    if isinstance(target, RemoteLLM):   # the lab's target is a server: engine_for gave its address
        if base_url is not None:
            raise ValueError("give either a target or base_url=, not both")
        target, base_url = None, target.base_url
    requests = list(requests)
    if not requests:
        raise ValueError("requests is empty; build some with make_requests(...)")
    if (target is None) == (base_url is None):
        raise ValueError("give either an in-process target (an LLM or LLMEngine) or base_url=, not "
                         f"{'both' if target is not None else 'neither'}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 or None, got {max_concurrency}")
    settings = dict(request_rate=request_rate, max_concurrency=max_concurrency, burstiness=burstiness,
                    seed=seed, ignore_eos=ignore_eos, num_requests=len(requests))
    liverun = LiveRun(len(requests), title=title or name, interval_s=interval_s, enabled=live)
    with LoadProbe() as probe:
        if base_url is not None:
            result = _run_http(base_url.rstrip("/"), requests, settings, liverun, name, model, chat)
        else:
            result = _run_engine(_engine_of(target), requests, settings, liverun, name)
    result.load = probe.load
    return result


class _Observed:
    """The engine as run_inprocess sees it, plus a hook after every step: counts finished
    requests, samples the engine's state and drives the live figure."""

    def __init__(self, engine, liverun, t0: float):
        self._engine, self._live, self._t0 = engine, liverun, t0
        self.ids: list[str] = []
        self.done = 0
        self.preemptions = 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def add_request(self, request_id, prompt, params=None, **kwargs):
        try:
            self._engine.add_request(request_id, prompt, params, **kwargs)
        except ValueError:
            self.done += 1
            raise
        self.ids.append(str(request_id))

    def step(self):
        before = self._engine.last_step_stats
        outputs = self._engine.step()
        s = self._engine.last_step_stats
        live = self._live
        if s is not None and s is not before:
            self.preemptions += s.num_preemptions
            t = s.start_s + s.step_time_s - (self._t0 - self._engine.start_s)
            live.add_state(t, s.num_running, s.num_waiting, s.kv_cache_usage, self.preemptions)
        now = time.perf_counter() - self._t0
        for out in outputs:
            if out.finished:
                self.done += 1
                m = out.metrics
                live.add_finished(now, m.ttft_s if m else None, m.tpot_s if m else None)
        live.tick(self.done, idle=not self._engine.has_unfinished_requests())
        return outputs


def _run_engine(engine, requests, settings, liverun, name) -> RunResult:
    from minserve.bench.inprocess import run_inprocess
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine still has unfinished requests; finish or abort them first "
                           "(a lab run must have the engine to itself to measure it)")
    t0 = time.perf_counter()
    first_step = engine.num_steps  # a step index, not a list position: the history is bounded
    observed = _Observed(engine, liverun, t0)
    liverun.start()
    try:
        bench = run_inprocess(observed, requests, request_rate=settings["request_rate"],
                              burstiness=settings["burstiness"], seed=settings["seed"],
                              max_concurrency=settings["max_concurrency"],
                              ignore_eos=settings["ignore_eos"], disable_tqdm=True)
    except BaseException:
        engine.abort_request([i for i in observed.ids if i in engine.requests])
        liverun.finish(observed.done)
        raise
    duration = time.perf_counter() - t0
    shift = t0 - engine.start_s  # engine-relative seconds -> run-relative seconds
    steps = engine.steps_frame()
    steps = steps[steps.step >= first_step].reset_index(drop=True)
    steps["t_s"] = steps["start_s"] - shift
    # Requests in the step: one decode row per decoding request once the proposals verified with
    # it (speculative decoding) are taken out, plus one per prefill chunk.
    steps["batch"] = (steps["num_decode_tokens"] - steps["num_spec_tokens"]
                      + steps["prefill_chunks"].map(len))
    frame, timelines = _engine_requests(engine, observed.ids, requests, shift, steps)
    state = _state_from_steps(steps)
    result = RunResult(name=name, target="engine", requests=frame, state=state, summary=bench.summary,
                       duration_s=duration, settings={**settings, **_engine_settings(engine)},
                       steps=steps, timelines=timelines, bench=bench)
    result.figure = liverun.finish(observed.done, result)
    return result


def _engine_settings(engine) -> dict:
    c = engine.config
    return {"model": c.model, "device": str(c.device), "max_num_seqs": c.max_num_seqs,
            "max_num_batched_tokens": c.max_num_batched_tokens,
            "num_kv_blocks": engine.kv_spec.num_blocks, "block_size": c.block_size,
            "enable_chunked_prefill": c.enable_chunked_prefill,
            "enable_prefix_caching": c.enable_prefix_caching}


def _index_of(engine_id: str, order: int) -> int:
    """run_inprocess names request i ``<prefix>-<i>``; fall back to the order of admission."""
    tail = engine_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else order


def _engine_requests(engine, ids, requests, shift, steps):
    """The engine's request frame for this run (run-relative times) and per-request timelines."""
    wanted = set(ids)
    records = [r for r in list(engine.finished_requests) + list(engine.requests.values())
               if r.request_id in wanted]
    df = engine.requests_frame()
    df = df[df.request_id.isin(wanted)].copy()
    for col in ("arrival_s", "first_scheduled_s", "first_token_s", "finished_s"):
        df[col] = df[col] - shift
    order = {rid: k for k, rid in enumerate(ids)}
    idx = [_index_of(rid, order[rid]) for rid in df.request_id]
    df["engine_id"] = df.request_id
    df["token_times_s"] = [[t - shift for t in ts] for ts in df.token_times_s]
    df["request_id"] = [requests[i].request_id or str(i) for i in idx]
    df["label"] = [requests[i].scenario or requests[i].request_id for i in idx]
    df["success"] = df.finish_reason.isin(["stop", "length"])
    df = df.sort_values("arrival_s", kind="stable").reset_index(drop=True)

    chunks: dict[str, list] = {}
    for row in steps.itertuples(index=False):
        for rid, ctx, n in row.prefill_chunks:
            if rid in wanted:
                chunks.setdefault(rid, []).append((row.t_s, row.t_s + row.step_time_s, ctx, n))
    timelines = {}
    for r in records:
        tl = r.timeline
        timelines[r.request_id] = {
            "scheduled_s": [t - engine.start_s - shift for t in tl.scheduled_s],
            "preempted_s": [t - engine.start_s - shift for t in tl.preempted_s],
            "chunks": chunks.get(r.request_id, []),
        }
    return df[REQUEST_COLUMNS].copy(), timelines


def _state_from_steps(steps) -> "pd.DataFrame":
    import pandas as pd
    if steps.empty:
        return pd.DataFrame(columns=STATE_COLUMNS)
    return pd.DataFrame({
        "t_s": steps.t_s + steps.step_time_s, "num_running": steps.num_running,
        "num_waiting": steps.num_waiting, "kv_cache_usage": steps.kv_cache_usage,
        "num_preemptions": steps.num_preemptions.cumsum()})


# ---- over HTTP --------------------------------------------------------------------------------

def _run_http(base_url, requests, settings, liverun, name, model, chat) -> RunResult:
    """The bench client's pieces, run on a private event loop in a thread, while this thread
    redraws the live figure from the records and /metrics samples as they arrive."""
    from minserve.bench.metrics import output_len, request_tpot
    box: dict[str, Any] = {}
    records: list = []
    pollers: list = []

    def work():
        try:
            box["out"] = asyncio.run(_http_main(base_url, requests, settings, model, chat, records,
                                                pollers))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=work, name="minserve-lab-http", daemon=True)
    t0 = time.perf_counter()
    liverun.start()
    thread.start()
    seen_samples = seen_records = 0
    while thread.is_alive():
        thread.join(timeout=liverun.interval_s / 2)
        samples = pollers[0].samples if pollers else []
        for smp in samples[seen_samples:]:
            liverun.add_state(smp["t"], smp["num_requests_running"], smp["num_requests_waiting"],
                              smp["kv_cache_usage_perc"], smp["num_preemptions_total"])
        seen_samples = len(samples)
        for rec in records[seen_records:]:
            if rec.success:  # the bench's TPOT (finalize computes the same one for the frame)
                liverun.add_finished(rec.start_time + rec.latency - t0, rec.ttft,
                                     request_tpot(rec, output_len(rec)))
            else:
                liverun.add_finished(time.perf_counter() - t0, None, None)
        seen_records = len(records)
        liverun.tick(seen_records, idle=True)  # this thread only watches: drawing delays no request
    if "error" in box:
        liverun.finish(len(records))
        raise box["error"]
    bench, model_id = box["out"]
    frame = _http_requests(bench.requests, requests)
    state = _state_from_metrics(bench.server_metrics)
    result = RunResult(name=name, target=base_url, requests=frame, state=state, summary=bench.summary,
                       duration_s=float(bench.summary.get("duration", time.perf_counter() - t0)),
                       settings={**settings, "model": model_id, "base_url": base_url}, bench=bench)
    result.figure = liverun.finish(len(records), result)
    return result


async def _http_main(base_url, requests, settings, model, chat, records, pollers):
    import contextlib

    import httpx

    from minserve.bench.arrivals import arrival_times
    from minserve.bench.client import TIMEOUT_S, Target, auth_headers, send_request
    from minserve.bench.results import BenchOptions, BenchResult, finalize
    from minserve.bench.server_metrics import MetricsPoller

    from minserve.lab.target import headers_for, key_for
    from minserve.lab.traffic import _first_model
    headers = headers_for(base_url)   # the lab target's key, else $OPENAI_API_KEY as vllm sends it
    if headers is None:
        headers = auth_headers()
    model_id = model or await _first_model(base_url, key_for(base_url))
    target = Target(api_url=f"{base_url}/v1/{'chat/completions' if chat else 'completions'}",
                    base_url=base_url, model=model_id, chat=chat)
    opts = BenchOptions(request_rate=settings["request_rate"], burstiness=settings["burstiness"],
                        seed=settings["seed"], max_concurrency=settings["max_concurrency"],
                        ignore_eos=settings["ignore_eos"])
    limits = httpx.Limits(max_connections=opts.max_concurrency, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=TIMEOUT_S, limits=limits, headers=headers) as client, \
            httpx.AsyncClient(timeout=5.0, headers=headers) as metrics_client:
        t0 = time.perf_counter()
        # Twice a second: a short lab run must show the gauges move (the CLI polls every 1 s).
        poller = MetricsPoller(metrics_client, f"{base_url}/metrics", 0.5, t0)
        pollers.append(poller)
        poller.start()
        times = arrival_times(len(requests), opts.request_rate, opts.burstiness, opts.seed)
        limit = (asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency
                 else contextlib.nullcontext())
        slots: list = [None] * len(requests)

        async def one(i, req, t):
            async with limit:
                rec = await send_request(client, target, req, opts.ignore_eos, float(t))
            slots[i] = rec
            records.append(rec)

        tasks = []
        try:
            for i, (req, t) in enumerate(zip(requests, times)):
                delay = t0 + t - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i, req, t)))
            await asyncio.gather(*tasks)
        finally:
            duration = time.perf_counter() - t0
            await poller.stop()
    meta = {"backend": "openai-chat" if chat else "openai", "model_id": model_id,
            "tokenizer_id": model_id, "num_prompts": len(requests)}
    summary, frame = finalize(slots, duration, t0, meta, opts, None)
    return BenchResult(summary=summary, requests=frame, server_metrics=poller.frame()), model_id


def _emission_times(first_s: float, itls: Sequence[float]) -> list[float]:
    """A client's emission times (streamed chunks that carried output) from its first one and its
    ITLs: the inverse of ``latency.itls_s`` over emissions, which the bench record keeps instead
    of the times themselves."""
    return [float(t) for t in np.cumsum([first_s, *itls])]


def _http_requests(bench_frame, requests) -> "pd.DataFrame":
    """The bench client's requests frame in this module's columns. Its latencies are kept as the
    bench computed them (:mod:`minserve.bench.metrics`): the client sees emissions (chunks), not
    the engine's tokens, and E2E ends at its last chunk, which stands in for the last token in
    ``decode_s`` as in TPOT (so ``tpot_s = decode_s / (output_tokens - 1)``, as in process).
    ``token_times_s`` are emission times: one per chunk, so several tokens a chunk brought show
    once (not repeated as in the engine's timelines; ``latency.itls_s`` reads both alike)."""
    import pandas as pd

    from minserve.metrics import latency as lat
    nan = math.nan
    b = bench_frame
    first_token_s = b.send_s + b.ttft_s
    df = pd.DataFrame({
        "request_id": b.request_id.astype(str),
        "label": [r.scenario or r.request_id for r in requests],
        "prompt_tokens": b.prompt_len, "output_tokens": b.output_len, "cached_tokens": nan,
        "num_preemptions": nan, "arrival_s": b.send_s, "first_scheduled_s": nan,
        "first_token_s": first_token_s, "finished_s": b.finish_s, "queue_s": nan,
        "ttft_s": b.ttft_s, "prefill_s": nan, "decode_s": lat.elapsed_s(first_token_s, b.finish_s),
        "tpot_s": b.tpot_s, "e2e_s": b.e2el_s,
        "itl_max_s": [max(x) if len(x) else nan for x in b.itl_s],
        "success": b.success, "engine_id": None,
        "token_times_s": [_emission_times(f, itl) if ok else []
                          for f, itl, ok in zip(first_token_s, b.itl_s, b.success)]})
    return df.sort_values("arrival_s", kind="stable").reset_index(drop=True)[REQUEST_COLUMNS]


def _state_from_metrics(sm) -> "pd.DataFrame":
    import pandas as pd
    if sm is None or sm.empty:
        return pd.DataFrame(columns=STATE_COLUMNS)
    return pd.DataFrame({"t_s": sm.t, "num_running": sm.num_requests_running,
                         "num_waiting": sm.num_requests_waiting,
                         "kv_cache_usage": sm.kv_cache_usage_perc,
                         "num_preemptions": sm.num_preemptions_total - sm.num_preemptions_total.iloc[0]})
