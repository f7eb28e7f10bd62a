"""How much load an engine takes, and what limits it: static vs continuous batching, load sweeps,
KV-cache pressure (labs 02 and 03).

minserve's scheduler batches continuously: a finished request leaves the batch at once and a
waiting one takes its seat in the next step (see ``engine/scheduler.py``). To show what that buys,
:class:`StaticBatcher` puts a *static-batching* front door on the very same engine:

- requests that arrive are held outside the engine (their arrival time is stamped then);
- only when the engine is empty does the next batch of up to ``batch_size`` held requests
  (oldest first) go in, together;
- that batch then runs until its longest member has finished; nobody joins it meanwhile.

So the two runs share the model, the kernels and the step budget; only the admission rule differs.
One simplification, in static batching's favour: a real static batcher pads the finished members
and keeps computing their seats until the batch ends, while here a finished member leaves the
step (the step gets a little cheaper). The wasted *seats* are the same, and that is what the lab
counts.

:func:`mixed_requests` is the workload both batching policies get: prompt and output lengths
drawn from a skewed mix (most answers short, a few long), which is what makes a static batch wait
for its slowest member. :func:`run_mixed` is the whole experiment in one call (the labs' control
panel runs it).

:func:`achieved_rate` is the throughput a load sweep plots against the offered load: requests
taken into a seat per second while requests keep arriving (see there for why not finished requests
over the whole run). :func:`load_table` turns ``{offered load: RunResult}`` (a sweep of request
rates or concurrency) into one row per run: offered and achieved throughput, TTFT and queue time
percentiles, waiting requests and preemptions, so a lab can plot what extra load turns into.

For the KV cache: :func:`kv_allocation` puts the formula for K/V bytes per token
(:func:`kv_bytes_per_token`, float or int8 cache) next to what the engine actually allocated;
:func:`steps_taken` counts the engine steps each request lived through (a request nobody delays
needs one step per output token, after its prefill); and
:func:`pressure_table` summarizes a concurrency sweep: peak KV blocks, waiting requests,
preemptions, queue time and latency, one row per run; :func:`plot_kv_usage` draws each run's KV
usage over time with its preemptions (the detective's figure).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

# The KV formula's one home is the engine's sizing module; the labs read it from here too.
from minserve.engine.kv_sizing import kv_bytes_per_token  # noqa: F401

if TYPE_CHECKING:
    import pandas as pd


class StaticBatcher:
    """An engine (or ``LLM``) behind a static-batching gate; pass it to
    :func:`~minserve.lab.workload.run_workload` in place of the engine.

    Held requests count as waiting in the run's ``state`` and step records (as they would on a
    static-batching server), and their queue time runs from the moment they arrived at the gate,
    because the arrival time is handed to ``add_request``. Everything else is the engine's own.
    """

    def __init__(self, target, batch_size: int):
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        engine = getattr(target, "llm_engine", target)
        if not hasattr(engine, "step") or not hasattr(engine, "add_request"):
            raise ValueError(f"target must be an LLM or an LLMEngine, got {type(target).__name__}")
        seats = engine.config.max_num_seqs
        if batch_size > seats:
            raise ValueError(f"batch_size={batch_size} is more than the engine's max_num_seqs={seats}: "
                             "a static batch must fit in the engine's seats")
        self._engine = engine
        self.batch_size = int(batch_size)
        self.held: deque[tuple[str, Any, Any, dict]] = deque()
        self.batches: list[list[str]] = []          # request ids of each batch released, in order
        self._held_after: dict[int, int] = {}       # step number -> requests held after that step
        self._raw = self._adjusted = None

    def __getattr__(self, name):  # everything else is the engine's
        return getattr(self._engine, name)

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request_id, prompt, params=None, arrival_time: float | None = None,
                    **kwargs) -> None:
        """Hold the request at the gate; its arrival (wall clock, as the engine expects) is now.
        The engine's own input checks run here, so a request the engine would refuse raises
        ValueError to the caller now rather than later, inside a step."""
        from minserve.engine.inputs import check_cache_salt, check_params, check_prompt_fits, prompt_ids
        eng, rid = self._engine, str(request_id)
        if rid in eng.requests or any(h[0] == rid for h in self.held):
            raise ValueError(f"request_id {rid!r} is already in use")
        check_cache_salt(kwargs.get("cache_salt"))
        if params is not None:
            check_params(params, eng.model_config.vocab_size, eng.eos_token_ids)
        _, ids = prompt_ids(prompt, eng.tokenizer, eng.model_config.vocab_size)
        check_prompt_fits(len(ids), eng.config, eng.max_model_len)
        if arrival_time is None:
            arrival_time = time.perf_counter() + self._engine.output_processor.clock_offset_s
        self.held.append((rid, prompt, params, {**kwargs, "arrival_time": arrival_time}))

    def has_unfinished_requests(self) -> bool:
        return bool(self.held) or self._engine.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.held) + self._engine.get_num_unfinished_requests()

    def abort_request(self, request_id) -> None:
        ids = {str(request_id)} if isinstance(request_id, str) else {str(r) for r in request_id}
        self.held = deque(h for h in self.held if h[0] not in ids)
        self._engine.abort_request(list(ids))

    # -- steps --------------------------------------------------------------------------------
    def step(self):
        eng = self._engine
        if self.held and not eng.has_unfinished_requests():
            batch = []
            while self.held and len(batch) < self.batch_size:
                rid, prompt, params, kw = self.held.popleft()
                eng.add_request(rid, prompt, params, **kw)
                batch.append(rid)
            self.batches.append(batch)
        outputs = eng.step()
        s = eng.last_step_stats
        if s is not None and s.step not in self._held_after:
            self._held_after[s.step] = len(self.held)
        return outputs

    @property
    def last_step_stats(self):
        """The engine's last step record, with the held requests counted as waiting."""
        s = self._engine.last_step_stats
        if s is None:
            return None
        if s is not self._raw:
            self._raw = s
            self._adjusted = dataclasses.replace(
                s, num_waiting=s.num_waiting + self._held_after.get(s.step, 0))
        return self._adjusted

    def steps_frame(self):
        """The engine's step records, ``num_waiting`` counting the requests held at the gate."""
        df = self._engine.steps_frame()
        if len(df):
            df["num_waiting"] = df.num_waiting + df.step.map(self._held_after).fillna(0).astype(int)
        return df


def run_static(target, requests: Sequence, batch_size: int, **run_args):
    """:func:`~minserve.lab.workload.run_workload` through a :class:`StaticBatcher` of
    ``batch_size``; ``run_args`` as for run_workload (``request_rate``, ``live``, ``name``...).
    The gate is kept on the result as ``result.settings["static_batches"]`` (request ids)."""
    from minserve.lab.workload import run_workload
    gate = StaticBatcher(target, batch_size)
    run_args.setdefault("name", f"static batches of {batch_size}")
    result = run_workload(gate, requests, **run_args)
    result.settings["batching"] = "static"
    result.settings["static_batch_size"] = int(batch_size)
    result.settings["static_batches"] = [list(b) for b in gate.batches]
    return result


# ---- the mixed workload ------------------------------------------------------------------------

# Output lengths as fractions of the longest, and how often each comes up: most answers are short,
# one in five is long. A static batch of four then usually holds one long answer that keeps the
# other three seats idle once their short answers are done.
OUTPUT_MIX = ((1 / 12, 0.20), (1 / 6, 0.25), (1 / 4, 0.20), (1 / 3, 0.15), (2 / 3, 0.10), (1.0, 0.10))


def mixed_lengths(num_requests: int, prompt_tokens: int, output_tokens: int,
                  seed: int = 0) -> tuple[list[int], list[int]]:
    """(prompt lengths, output lengths) of the mixed workload: prompts uniform between a quarter
    of ``prompt_tokens`` and ``prompt_tokens``; outputs from :data:`OUTPUT_MIX` scaled to
    ``output_tokens`` (the longest answer). The same seed gives the same lengths."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if prompt_tokens < 1 or output_tokens < 1:
        raise ValueError(f"prompt_tokens and output_tokens must be >= 1, got {prompt_tokens} and "
                         f"{output_tokens}")
    rng = np.random.default_rng(seed)
    fractions, weights = zip(*OUTPUT_MIX)
    outs = rng.choice(np.array(fractions), size=num_requests, p=np.array(weights))
    outputs = [max(1, int(round(f * output_tokens))) for f in outs]
    prompts = [int(x) for x in rng.integers(max(1, prompt_tokens // 4), prompt_tokens + 1,
                                            size=num_requests)]
    return prompts, outputs


def mixed_requests(tokenizer, num_requests: int, prompt_tokens: int, output_tokens: int,
                   seed: int = 0) -> list:
    """The mixed workload as requests (see :func:`mixed_lengths`), labelled ``r03 (12 out)``."""
    from minserve.lab.workload import make_requests
    prompts, outputs = mixed_lengths(num_requests, prompt_tokens, output_tokens, seed)
    labels = [f"r{i:02d} ({o} out)" for i, o in enumerate(outputs)]
    return make_requests(tokenizer, prompts, outputs, labels=labels, seed=seed)


def run_mixed(preset=None, *, batching: str = "continuous", num_requests: int = 16,
              request_rate: float = math.inf, max_concurrency: int | None = None,
              prompt_tokens: int = 32, output_tokens: int = 48, max_num_seqs: int | None = None,
              max_num_batched_tokens: int | None = None, num_kv_blocks: int | None = None,
              seed: int = 0, live: bool = True, name: str | None = None, **engine_args):
    """One run of the mixed workload on the notebook's engine (see
    :func:`~minserve.lab.session.engine_for`; None keeps the preset's setting), batched
    ``"continuous"`` (the engine as it is) or ``"static"`` (batches of ``max_num_seqs``, see
    :class:`StaticBatcher`). ``prompt_tokens`` / ``output_tokens`` are the longest prompt and answer
    of the mix. Returns the :class:`~minserve.lab.workload.RunResult`."""
    from minserve.lab.presets import get_preset
    from minserve.lab.session import engine_for
    from minserve.lab.workload import run_workload
    if batching not in ("continuous", "static"):
        raise ValueError(f"batching must be 'continuous' or 'static', got {batching!r}")
    preset = preset or get_preset()
    llm = engine_for(preset, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     num_kv_blocks=num_kv_blocks, **engine_args)
    reqs = mixed_requests(llm.get_tokenizer(), num_requests, prompt_tokens, output_tokens, seed)
    rate = "all at once" if math.isinf(request_rate) else f"{request_rate:g} req/s"
    label = name or f"{batching}: {num_requests} mixed requests, {rate}"
    if batching == "static":
        from minserve.lab.target import RemoteLLM
        if isinstance(llm, RemoteLLM):
            from minserve.lab.workload import EngineRecordsRequired
            raise EngineRecordsRequired("static batching (a gate in front of this notebook's engine)")
        return run_static(llm, reqs, llm.llm_engine.config.max_num_seqs, request_rate=request_rate,
                          max_concurrency=max_concurrency, seed=seed, live=live, name=label)
    return run_workload(llm, reqs, request_rate=request_rate, max_concurrency=max_concurrency,
                        seed=seed, live=live, name=label)


# ---- what a run did with its seats -------------------------------------------------------------

def seat_use(run, seats: int) -> dict[str, float]:
    """How the run used ``seats`` batch places over its steps: ``steps``, ``seat_steps``
    (seats x steps), ``busy_seat_steps`` (requests computed, summed over steps) and
    ``empty_share`` (the fraction of seat-steps nobody used)."""
    run.require_engine("seat_use")
    st = run.steps
    steps = int(len(st))
    busy = int(st.batch.sum())
    total = seats * steps
    return {"steps": steps, "seat_steps": total, "busy_seat_steps": busy,
            "empty_share": (1 - busy / total) if total else math.nan}


def running_over_time(run):
    """(t_s, requests in the batch) per step of an in-process run, for a step plot."""
    run.require_engine("running_over_time")
    st = run.steps
    return st.t_s.to_numpy(float), st.batch.to_numpy(float)


# ---- a sweep, one row per run ------------------------------------------------------------------

def achieved_rate(run, seats: int | None = None) -> float:
    """The throughput of a run in steady state, in requests per second: the rate at which the
    engine took requests into a seat, from the first request that could have had to wait (the
    ``seats + 1``-th admitted; ``seats`` defaults to the run's ``max_num_seqs``) to the last.

    Why admissions, not "finished requests / run time": a run of N requests offered at a rate
    ends with a drain. After the last arrival nobody new comes, the engine only finishes what it
    has, so N / run time is N / (N / rate + the last requests' own latency): on a 16-request run
    that read 90 % of the offered load at a point where nobody had waited, and it moved with the
    length of whichever answer happened to come last. In a steady state every request taken in
    is a request finished later, so the rate of admissions *is* the throughput, and it is measured
    while requests still arrive. While the engine keeps up, each request is admitted as it
    arrives and this is the offered rate itself; once the seats are full, a request is admitted
    only when another one finishes, and this is the rate at which the engine finishes them. The
    first ``seats`` requests are left out because they find empty seats at any load. (It is also
    the same thing seen from the queue: admissions fall behind arrivals exactly when, and by as
    much as, the queue builds.)

    Over HTTP (no admission times) the first-token times stand in for them, and the seats are
    the most requests the server's ``/metrics`` showed running (a client cannot read its
    ``max_num_seqs``); a server that ran every request at once never made one wait, so it shows
    no steady state and the whole-run throughput is all there is. Falls back to the whole-run
    ``request_throughput`` too when the run has too few requests to measure a rate."""
    r = run.requests[run.requests.success]
    times = r.first_scheduled_s.to_numpy(float) if "first_scheduled_s" in r else np.array([])
    if not len(times) or not np.isfinite(times).all():
        times = r.first_token_s.to_numpy(float)
    times = np.sort(times[np.isfinite(times)])
    if seats is None:
        seats = run.settings.get("max_num_seqs")
        if not seats:   # over HTTP: the seats the server showed in use
            seats = _peak_running(run)
            if seats is not None and seats >= len(times):   # nobody ever waited
                return float(run.summary.get("request_throughput", math.nan))
        seats = int(seats or 1)
    skip = min(int(seats), max(0, len(times) - 3))  # keep at least three admissions
    span = times[-1] - times[skip] if len(times) >= 2 else 0.0
    if len(times) - skip < 2 or span <= 0:
        return float(run.summary.get("request_throughput", math.nan))
    return float((len(times) - 1 - skip) / span)


def _peak_running(run) -> int | None:
    """The most requests the run's state samples saw running (None without samples)."""
    state = getattr(run, "state", None)
    if state is None or "num_running" not in state or not state.num_running.notna().any():
        return None
    return int(state.num_running.max())


def load_table(runs: dict, offered: str = "offered req/s") -> "pd.DataFrame":
    """One row per run of a load sweep ``{offered load: RunResult}`` (keys: request rates, or
    concurrency levels; the index is named ``offered``). Columns: achieved requests per second
    (:func:`achieved_rate`: in steady state, without the drain at the end), finished requests per
    second over the whole run (``whole-run req/s``: what a benchmark's ``request_throughput``
    reports, drain included) and output tokens per second over the run, median and p90 TTFT and
    queue time (ms), the median share of TTFT spent queued, the most requests seen waiting, and
    preemptions."""
    import pandas as pd
    rows = []
    for load, run in runs.items():
        r = run.requests[run.requests.success]
        queue = r.queue_s.to_numpy(float)
        ttft = r.ttft_s.to_numpy(float)
        share = np.where(ttft > 0, queue / np.where(ttft > 0, ttft, 1.0), np.nan)
        s = run.summary
        rows.append({
            offered: float(load),
            "achieved req/s": achieved_rate(run),
            "whole-run req/s": float(s.get("request_throughput", math.nan)),
            "output tok/s": float(s.get("output_throughput", math.nan)),
            "median TTFT (ms)": _pct(ttft, 50) * 1000, "p90 TTFT (ms)": _pct(ttft, 90) * 1000,
            "median queue (ms)": _pct(queue, 50) * 1000, "p90 queue (ms)": _pct(queue, 90) * 1000,
            "median queue share of TTFT": _pct(share, 50),
            "median TPOT (ms)": _pct(r.tpot_s.to_numpy(float), 50) * 1000,
            "median E2E (ms)": _pct(r.e2e_s.to_numpy(float), 50) * 1000,
            "max waiting": float(run.state.num_waiting.max()) if len(run.state) else math.nan,
            "preemptions": float(run.state.num_preemptions.max()) if len(run.state) else math.nan,
            "duration (s)": float(run.duration_s),
        })
    return pd.DataFrame(rows).set_index(offered)


def _pct(v, q) -> float:
    v = np.asarray(v, dtype=float)
    v = v[np.isfinite(v)]
    return float(np.percentile(v, q)) if len(v) else math.nan


# ---- KV cache: the formula, the allocation, the pressure ----------------------------------------

def kv_allocation(target) -> dict[str, Any]:
    """The KV cache of an engine (or ``LLM``): the formula's parts (``layers``, ``kv_heads``,
    ``head_dim``, ``dtype_bytes`` of one stored K/V number, ``scale_bytes`` per token and KV head:
    0 for a float cache, 4 for ``kv_cache_dtype="int8"``), ``formula_bytes_per_token``
    (:func:`kv_bytes_per_token` of those parts), ``kv_cache_dtype``, the engine's own
    ``bytes_per_token`` (``engine.kv_spec``), ``num_blocks``, ``block_size``, and
    ``tensor_bytes``: the bytes of every KV tensor the model runner really allocated (every layer:
    K and V, and with an int8 cache their scales too). The element sizes are read from those
    tensors, so the formula describes what is stored."""
    eng = getattr(target, "llm_engine", target)
    cfg, spec = eng.model_config, eng.kv_spec
    layers = eng.runner.kv_caches
    tensors = [t for layer in layers for t in layer]
    # A layer holds (k, v), or with kv_cache_dtype="int8" (k_codes, v_codes, k_scales, v_scales).
    dtype_bytes = layers[0][0].element_size() if layers else 0
    scale_bytes = layers[0][2].element_size() if layers and len(layers[0]) == 4 else 0
    return {
        "layers": int(cfg.num_layers), "kv_heads": int(cfg.num_kv_heads), "head_dim": int(cfg.head_dim),
        "dtype_bytes": int(dtype_bytes), "scale_bytes": int(scale_bytes),
        "formula_bytes_per_token": kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                                      dtype_bytes, scale_bytes),
        "kv_cache_dtype": str(spec.kv_cache_dtype),
        "bytes_per_token": int(spec.bytes_per_token), "num_blocks": int(spec.num_blocks),
        "block_size": int(spec.block_size),
        "tensor_bytes": int(sum(t.numel() * t.element_size() for t in tensors)),
    }


def steps_taken(run) -> "pd.Series":
    """Engine steps that started while each request was in the engine (arrival to finish), indexed
    like ``run.requests``. A request nobody delays takes ``ceil(prompt / step budget) + output - 1``
    steps (its prefill chunks, the last of which samples the first token, then one step per
    further token); every step more is a step it spent waiting for a seat or for KV blocks, or
    recomputing after a preemption."""
    import pandas as pd
    run.require_engine("steps_taken")
    starts = np.sort(run.steps.t_s.to_numpy(float))
    r = run.requests
    lo = np.searchsorted(starts, r.arrival_s.to_numpy(float) - 1e-9, side="left")
    hi = np.searchsorted(starts, r.finished_s.to_numpy(float), side="left")
    return pd.Series(hi - lo, index=r.index, name="steps")


def extra_steps(run) -> "pd.Series":
    """:func:`steps_taken` minus what the request needs alone (see there): the steps it was held up."""
    budget = int(run.settings["max_num_batched_tokens"])
    r = run.requests
    alone = -(-r.prompt_tokens // budget) + r.output_tokens - 1
    return (steps_taken(run) - alone).rename("extra_steps")


def pressure_table(runs: dict, num_blocks: int | None = None, offered: str = "concurrency") -> "pd.DataFrame":
    """One row per run of a sweep ``{load: RunResult}`` (e.g. concurrency levels): the peak KV
    usage (blocks and %), the most requests running and waiting at once, preemptions, p90 queue
    time, median and slowest E2E, and the most steps a request was held up (:func:`extra_steps`)."""
    import pandas as pd
    rows = []
    for load, run in runs.items():
        run.require_engine("pressure_table")
        st, r = run.steps, run.requests
        blocks = num_blocks or int(run.settings["num_kv_blocks"])
        rows.append({
            offered: load,
            "peak KV blocks": int(round(float(st.kv_cache_usage.max()) * blocks)),
            "peak KV (%)": 100 * float(st.kv_cache_usage.max()),
            "max running": int(st.num_running.max()), "max waiting": int(st.num_waiting.max()),
            "preemptions": int(st.num_preemptions.sum()),
            "p90 queue (ms)": 1000 * _pct(r.queue_s, 90),
            "median E2E (s)": _pct(r.e2e_s, 50), "slowest E2E (s)": float(r.e2e_s.max()),
            "most extra steps": int(extra_steps(run).max()),
        })
    return pd.DataFrame(rows).set_index(offered)


def plot_kv_usage(panels: Sequence[tuple[str, Any]], title: str, panel_width: float = 2.1):
    """The detective's figure (labs 03 and 05): one panel per ``(label, RunResult)``, KV blocks in
    use (%) after each step of the run, a red line at every step that preempted, and the count of
    preemptions in the panel's title. Returns the figure."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(panels), figsize=(panel_width * len(panels), 2.9), sharey=True,
                             layout="constrained", squeeze=False)
    for ax, (label, run) in zip(axes[0], panels):
        steps = run.steps
        end_s = steps.t_s + steps.step_time_s   # a step's record is taken when it ends
        preempted = steps.num_preemptions > 0
        ax.plot(end_s, 100 * steps.kv_cache_usage, color="tab:purple")
        ax.vlines(end_s[preempted], 0, 105, color="tab:red", lw=1)
        count = int(steps.num_preemptions.sum())
        ax.set_title(f"{label}: {count} preemption{'s' if count != 1 else ''}", fontsize=9)
        ax.set(xlabel="time (s)", ylim=(0, 105))
    axes[0][0].set_ylabel("KV blocks in use (%)")
    fig.suptitle(title)
    return fig
