"""Drive an :class:`~minserve.engine.llm_engine.LLMEngine` directly with a benchmark workload.

Same workloads, same arrival process and same metrics as the HTTP client, without a server in
between: a notebook can offer load to an engine it holds and then look at the engine's own step
records next to the per-request latencies. The loop is a virtual schedule against
``time.perf_counter``: before every ``engine.step()`` it adds each request whose arrival time has
passed (and for which a concurrency slot is free, like the client's semaphore); when nothing is in
flight it sleeps until the next arrival.

A request is "sent" when ``add_request`` is called. An emission is a step output that carries
new tokens (one or several: a speculative-decoding step may accept more than one), stamped when
``step()`` returns (the moment a streaming server could flush it), so TTFT, ITL, TPOT and E2EL
mean what they mean for the HTTP client, minus network and HTTP overhead. The output token count
is exact (the engine's token ids, like a server's ``usage``).

The run's steps are found by step number (``StepStats.step`` against ``engine.num_steps`` at the
start), never by position in ``engine.step_stats``: that history is a bounded deque
(``max_step_records``), so once it is full a position points at a different step after every
step. A run longer than the history keeps only its latest ``max_step_records`` steps.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections import deque

from minserve.bench.arrivals import arrival_times
from minserve.bench.datasets import SampleRequest
from minserve.bench.manifest import LoadSampler, build_manifest, config_dict
from minserve.bench.metrics import RequestRecord, set_latencies
from minserve.bench.results import BenchOptions, BenchResult, finalize
from minserve.bench.workload_parts import PRIORITY_CLASSES
from minserve.sampling_params import RequestOutputKind, SamplingParams

IDLE_SLEEP_MAX_S = 0.05  # re-check at least this often while waiting for the next arrival

log = logging.getLogger(__name__)


class _Run:
    """Book-keeping of one in-process run: which requests are waiting, in flight, done."""

    def __init__(self, engine, requests: list[SampleRequest], opts: BenchOptions):
        self.engine, self.opts = engine, opts
        self.times = arrival_times(len(requests), opts.request_rate, opts.burstiness, opts.seed)
        self.pending = deque(range(len(requests)))
        self.requests = requests
        self.records = [RequestRecord(request_id=r.request_id or str(i), scenario=r.scenario,
                                      prompt_len=r.prompt_len, expected_output_len=r.expected_output_len,
                                      scheduled_s=float(t))
                        for i, (r, t) in enumerate(zip(requests, self.times))]
        self.prefix = f"bench-{uuid.uuid4().hex[:8]}-"  # engine ids must not clash across runs
        self.in_flight: dict[str, int] = {}
        self.emissions: dict[int, list[float]] = {}   # request index -> times of its emissions
        self.done = 0

    def admit(self, now_s: float) -> None:
        cap = self.opts.max_concurrency
        while self.pending and self.times[self.pending[0]] <= now_s and (
                cap is None or len(self.in_flight) < cap):
            i = self.pending.popleft()
            req, rec = self.requests[i], self.records[i]
            params = SamplingParams(temperature=0.0, max_tokens=req.expected_output_len,
                                    ignore_eos=self.opts.ignore_eos,
                                    output_kind=RequestOutputKind.DELTA)
            rec.start_time = time.perf_counter()
            # Only requests of a workload class carry a priority (duck-typed engines need not).
            extra = {"priority": class_priority(req.priority_class)} if req.priority_class else {}
            try:
                self.engine.add_request(self.prefix + str(i), req.prompt, params, **extra)
            except ValueError as e:  # e.g. a prompt longer than max_model_len
                rec.error = str(e)
                self.done += 1
                continue
            self.in_flight[self.prefix + str(i)] = i

    def collect(self, outputs, now: float) -> None:
        for out in outputs:
            i = self.in_flight.get(out.request_id)
            if i is None:
                continue
            rec, comp = self.records[i], out.outputs[0]
            rec.prompt_len = len(out.prompt_token_ids)  # what the engine actually prefilled
            rec.response_id = out.request_id
            if getattr(out, "num_cached_tokens", None) is not None:
                rec.cached_tokens = int(out.num_cached_tokens)
            if comp.token_ids:  # one emission, however many tokens the step appended
                self.emissions.setdefault(i, []).append(now)
                rec.output_tokens += len(comp.token_ids)
            rec.generated_text += comp.text
            if out.finished:
                self._finish(out.request_id, i, comp.finish_reason, now)

    def _finish(self, engine_id: str, i: int, reason: str | None, now: float) -> None:
        rec = self.records[i]
        del self.in_flight[engine_id]
        self.done += 1
        if reason in ("abort", "error") or not rec.output_tokens:
            rec.error = f"request finished with reason {reason!r} after {rec.output_tokens} tokens"
            self.emissions.pop(i, None)
            return
        emissions = self.emissions.pop(i)
        set_latencies(rec, emissions, emissions[-1])
        rec.success = True

    def idle_wait(self, t0: float) -> None:
        if self.pending:
            wait = t0 + self.times[self.pending[0]] - time.perf_counter()
            time.sleep(min(max(wait, 0.0), IDLE_SLEEP_MAX_S))


def class_priority(priority_class: str) -> int:
    """The engine ``priority`` of a request class: under ``scheduling_policy="priority"``
    interactive (0) runs before batch (1), as ``minserve serve`` ranks its classes; 0 unset."""
    return PRIORITY_CLASSES.index(priority_class) if priority_class in PRIORITY_CLASSES else 0


def run_inprocess(engine, requests: list[SampleRequest], request_rate: float = math.inf,
                  burstiness: float = 1.0, seed: int = 0, max_concurrency: int | None = None,
                  workload: dict | None = None, manifest: bool = True, **options) -> BenchResult:
    """Offer ``requests`` to ``engine`` at ``request_rate`` req/s and measure them.

    ``options`` are the other :class:`~minserve.bench.results.BenchOptions` fields
    (``ignore_eos``, ``percentile_metrics``, ``metric_percentiles``, ``goodput`` in ms,
    ``class_slos``, ``disable_tqdm``). Returns ``.summary`` (vLLM's result keys), ``.requests``
    (one row per request), ``.steps`` (``engine.steps_frame()`` rows of this run, with ``t_s`` =
    seconds since the run started, on the same clock as the request frame's
    ``send_s``/``finish_s``) and ``.manifest`` (:mod:`minserve.bench.manifest`; ``workload`` is
    its workload entry, e.g. ``Workload.describe()``; ``manifest=False`` skips it).
    """
    opts = BenchOptions(request_rate=request_rate, burstiness=burstiness, seed=seed,
                        max_concurrency=max_concurrency, **options)
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 or None, got {max_concurrency}")
    load = LoadSampler().start() if manifest else None
    run = _Run(engine, requests, opts)
    first_step = engine.num_steps  # a step index, not a list position: the history is bounded
    pbar = None
    if not opts.disable_tqdm:
        from tqdm import tqdm
        pbar = tqdm(total=len(requests))
    t0 = time.perf_counter()
    while run.done < len(requests):
        before = run.done
        run.admit(time.perf_counter() - t0)
        if run.in_flight:
            outputs = engine.step()
            run.collect(outputs, time.perf_counter())
        else:
            run.idle_wait(t0)
        if pbar is not None:
            pbar.update(run.done - before)
    duration = time.perf_counter() - t0
    if pbar is not None:
        pbar.close()
    model = engine.config.model
    meta = {"backend": "inprocess", "model_id": model, "tokenizer_id": model,
            "num_prompts": len(requests)}
    summary, frame = finalize(run.records, duration, t0, meta, opts, engine.tokenizer)
    result = BenchResult(summary=summary, requests=frame, steps=_steps(engine, first_step, t0))
    if load is not None:
        result.manifest = build_manifest(
            workload=workload or {"name": None, "note": "requests given directly, no workload named"},
            model=model, engine=config_dict(engine.config), server={"kind": "in-process"},
            bench=vars(opts), load=load.stop())
    return result


def _steps(engine, first_step: int, t0: float):
    """The steps this run took that the engine still holds, selected by step number."""
    frame = engine.steps_frame()
    steps = frame[frame.step >= first_step].reset_index(drop=True)
    lost = engine.num_steps - first_step - len(steps)
    if lost:
        log.warning("the run took %d steps; the engine keeps the latest %d (max_step_records), so "
                    "its first %d are not in .steps", engine.num_steps - first_step,
                    engine.config.max_step_records, lost)
    steps["t_s"] = steps["start_s"] - (t0 - engine.start_s)
    return steps
