"""Lab 06's measurements: the vLLM spec-decode counters, side-by-side runs of a plain and a
speculative engine, and the comparison they give (see lab06.py for how it is measured)."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

if TYPE_CHECKING:   # annotations only: the board module imports this one's results
    from course.lab06_board import Board


# ---- the counters ------------------------------------------------------------------------------

_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(llm) -> dict:
    """The engine's speculative-decoding counters now: ``drafts``, ``draft_tokens``,
    ``accepted``, and ``per_pos`` (an array, ``vllm:spec_decode_num_accepted_tokens_per_pos``
    by its ``position`` label, as ``engine.snapshot()`` lists it)."""
    snap = getattr(llm, "llm_engine", llm).snapshot()
    out: dict[str, Any] = {v: snap.get(k, 0.0) for k, v in _COUNTERS.items()}
    per_pos = {int(k[len(PER_POS) + len('{position="'):-2]): v for k, v in snap.items()
               if k.startswith(PER_POS + "{")}
    n = max(per_pos) + 1 if per_pos else 0
    out["per_pos"] = np.array([per_pos.get(i, 0.0) for i in range(n)])
    return out


def _add(a: dict, b: dict, sign: float = 1.0) -> dict:
    out = {k: a[k] + sign * b[k] for k in _COUNTERS.values()}
    x, y = a["per_pos"], b["per_pos"]
    n = max(len(x), len(y))
    out["per_pos"] = np.pad(x, (0, n - len(x))) + sign * np.pad(y, (0, n - len(y)))
    return out


def _zero() -> dict:
    return {**{k: 0.0 for k in _COUNTERS.values()}, "per_pos": np.zeros(0)}


# ---- runs --------------------------------------------------------------------------------------

@dataclass
class EngineRun:
    """One engine's run of one group of prompts (all added at once, stepped to the end)."""
    outputs: list[list[int]]
    steps: Any               # the engine's step records of this run (a DataFrame)
    counters: dict           # speculative-decoding counter deltas (zeros for a plain engine)
    trace: list[tuple[int, int]] = field(default_factory=list)  # (steps so far, tokens decoded so far)

    @property
    def decode(self):
        return decode_steps(self.steps)

    @property
    def decode_rate(self) -> float:
        """Output tokens per second over the decode-only steps, timed robustly (:func:`steady_time`)."""
        d = self.decode
        return float(d.produced.sum() / steady_time(d)) if len(d) else math.nan


def decode_steps(steps):
    """Decode-only steps (no prefill chunk) of a step frame, with ``rows`` (requests decoding
    in the step) and ``produced`` (output tokens the step gave them) added."""
    d = steps[(steps.num_prefill_tokens == 0) & (steps.num_decode_tokens > 0)].copy()
    d["rows"] = d.num_decode_tokens - d.num_spec_tokens
    d["produced"] = d.rows + d.num_accepted_spec_tokens
    return d


def steady_time(decode, window: int = 9, limit: float = 3.0) -> float:
    """The time of a run's decode steps with the machine's hiccups capped: a step that took more
    than ``limit`` times the median of the ``window`` steps around it (itself included) counts as
    that many medians. On a shared machine another process can take the CPU for a moment and make
    one step ten times slower; a plain sum would charge that to whichever engine was stepping.
    Real changes of cost (a verify step among plain ones, a batch that shrinks) stay well inside
    the limit and count in full."""
    t = decode.step_time_s.reset_index(drop=True)
    if t.empty:
        return 0.0
    med = t.rolling(window, center=True, min_periods=1).median()
    return float(np.minimum(t, limit * med).sum())


def run_side_by_side(llms: Sequence, prompts: Sequence[Sequence[int]], params,
                     on_step: Callable[[list], None] | None = None) -> list[EngineRun]:
    """Add ``prompts`` (token ids) to each engine at once, then step the engines in turn (one step
    each) until all are done. ``on_step(traces)`` is called after each round; a trace is the list
    of (steps taken, tokens decoded) of one engine."""
    from minserve.sampling_params import RequestOutputKind
    engs = [llm.llm_engine for llm in llms]
    for e in engs:
        if e.has_unfinished_requests():
            raise RuntimeError("an engine still has unfinished requests; a measured run needs it alone")
    p = params.clone()
    p.output_kind = RequestOutputKind.FINAL_ONLY
    before = [spec_counters(e) for e in engs]
    first = [e.num_steps for e in engs]
    tag = time.perf_counter_ns()
    ids = [f"lab06-{tag}-{i}" for i in range(len(prompts))]
    for e in engs:
        for rid, prompt in zip(ids, prompts):
            e.add_request(rid, {"prompt_token_ids": list(prompt)}, p)
    done: list[dict] = [{} for _ in engs]
    traces = [[(0.0, 0)] for _ in engs]
    while any(e.has_unfinished_requests() for e in engs):
        for j, e in enumerate(engs):
            if not e.has_unfinished_requests():
                continue
            for out in e.step():
                if out.finished:
                    done[j][out.request_id] = out
            s = e.last_step_stats
            if s is not None:
                steps_so_far, n = traces[j][-1]
                got = s.num_decode_tokens - s.num_spec_tokens + s.num_accepted_spec_tokens
                traces[j].append((steps_so_far + 1, n + got))
        if on_step is not None:
            on_step(traces)
    runs = []
    for j, e in enumerate(engs):
        steps = e.steps_frame()
        steps = steps[steps.step >= first[j]].reset_index(drop=True)
        outs = [list(done[j][r].outputs[0].token_ids) for r in ids]
        runs.append(EngineRun(outs, steps, _add(spec_counters(e), before[j], -1.0), traces[j]))
    return runs


@dataclass
class Pair:
    """Plain and speculative runs of the same groups of prompts: one row of the lab's tables."""
    workload: str
    k: int
    batch: int
    adaptive: bool
    plain: list[EngineRun] = field(default_factory=list)
    spec: list[EngineRun] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.workload}, k={self.k}, batch {self.batch}" + (", adaptive" if self.adaptive else "")

    @property
    def identical(self) -> bool:
        """Every request's greedy output is the same token for token with and without speculation."""
        return all(p.outputs == s.outputs for p, s in zip(self.plain, self.spec))

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for r in self.plain for o in r.outputs)

    @property
    def speedups(self) -> list[float]:
        return [s.decode_rate / p.decode_rate for p, s in zip(self.plain, self.spec)]

    @property
    def speedup(self) -> float:
        """Decode speed-up: median over the groups of (speculative / plain decode rate)."""
        v = [x for x in self.speedups if math.isfinite(x)]
        return statistics.median(v) if v else math.nan

    def counters(self) -> dict:
        out = _zero()
        for r in self.spec:
            out = _add(out, r.counters)
        return out

    @property
    def acceptance_rate(self) -> float:
        """vLLM's acceptance rate: accepted tokens / draft tokens."""
        c = self.counters()
        return c["accepted"] / c["draft_tokens"] if c["draft_tokens"] else math.nan

    @property
    def mean_accepted_len(self) -> float:
        """vLLM's mean acceptance length: 1 + accepted / drafts (tokens per verify step)."""
        c = self.counters()
        return 1 + c["accepted"] / c["drafts"] if c["drafts"] else math.nan

    def _decode(self, runs):
        import pandas as pd
        return pd.concat([r.decode for r in runs], ignore_index=True)

    @property
    def tokens_per_step(self) -> float:
        """Output tokens per request per target forward pass, over all decode-only steps of the
        speculative runs (a step that found nothing to propose counts with its one token)."""
        d = self._decode(self.spec)
        return float(d.produced.sum() / d.rows.sum()) if len(d) else math.nan

    @property
    def draft_step_share(self) -> float:
        """Share of the speculative engine's decode-only steps that verified proposals."""
        d = self._decode(self.spec)
        return float((d.num_spec_tokens > 0).mean()) if len(d) else math.nan

    @property
    def cost_ratio(self) -> float:
        """What a verify step costs, in plain steps: the median time of the speculative engine's
        decode-only steps that verified proposals over the median time of the plain engine's
        decode-only steps, both taken while (nearly) the whole group was decoding, at least 90 %
        of its requests: the speculative engine's requests finish at different steps, and the
        last steps of a run, with few requests left, are cheaper."""
        d, p = self._decode(self.spec), self._decode(self.plain)
        d = d[d.num_spec_tokens > 0]
        floor = 0.9 * self.batch
        full_d, full_p = d[d.rows >= floor], p[p.rows >= floor]
        if len(full_d) and len(full_p):
            d, p = full_d, full_p
        if not len(d) or not len(p):
            return math.nan
        return float(d.step_time_s.median() / p.step_time_s.median())

    def row(self) -> dict:
        return {"workload": self.workload, "k": self.k, "batch": self.batch, "adaptive": self.adaptive,
                "speed-up": self.speedup, "acceptance rate": self.acceptance_rate,
                "mean accepted length": self.mean_accepted_len,
                "tokens per target step": self.tokens_per_step,
                "steps with drafts": self.draft_step_share,
                "verify cost (plain steps)": self.cost_ratio,
                "plain tok/s": statistics.median(r.decode_rate for r in self.plain),
                "spec tok/s": statistics.median(r.decode_rate for r in self.spec),
                "identical": self.identical}


def compare(plain, spec, prompts: Sequence[Sequence[int]], params, *, batch: int = 1,
            workload: str = "", k: int | None = None, board: "Board | None" = None) -> Pair:
    """Plain and speculative decoding on the same prompts, ``batch`` at a time (each group
    stepped side by side, see :func:`run_side_by_side`); ``board`` shows it live."""
    cfg = spec.llm_engine.config.speculative_config
    pair = Pair(workload, int(k if k is not None else cfg.num_speculative_tokens), int(batch),
                bool(cfg.adaptive))
    if board is not None:
        board.add(pair)
    for i in range(0, len(prompts) - batch + 1, batch):
        group = prompts[i:i + batch]
        on_step = board.tick if board is not None else None
        p, s = run_side_by_side([plain, spec], group, params, on_step=on_step)
        pair.plain.append(p)
        pair.spec.append(s)
        if board is not None:
            board.update()
    if board is not None:
        board.update()
    return pair


def table(pairs: Sequence[Pair]):
    """One row per comparison (:meth:`Pair.row`)."""
    import pandas as pd
    return pd.DataFrame([p.row() for p in pairs])
