"""Lab 08 (the optimization lab): per-class objectives scaled to this machine, the per-class
tables of a run, the load sweep's SLO attainment, the bottleneck signals, the noise-aware
comparison of two configurations and the failure drills (a burst, a server restart).

Every function reads the frames the toolkit's runs leave behind: ``RunResult.requests`` (in
process, one row per request, times in seconds) and ``TrafficResult.requests`` (over HTTP)."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd

from minserve.lab.sidechannel import mann_whitney

METRICS = ("ttft", "tpot", "e2el")          # the workload's SLO keys, in ms (bench --goodput's names)
COLUMN = {"ttft": "ttft_s", "tpot": "tpot_s", "e2el": "e2e_s"}


# ---- objectives -------------------------------------------------------------------------------

def scaled_slos(workload, factor: float) -> dict[str, dict[str, float]]:
    """Each class's SLO from the workload file (``{"ttft": ms, ..}``), every bound times
    ``factor``: the files' objectives are for full-length requests on a serving GPU."""
    out = {}
    for name, c in workload.class_slos().items():
        out[name] = {k: round(v * factor, 1) for k, v in c["slo"].items() if k in METRICS}
    return out


def slo_factor(run, workload, headroom: float = 2.0) -> float:
    """The one factor that puts every class's light-load median (TTFT, TPOT, E2E) at most
    1/``headroom`` of its scaled bound: the machine's speed, measured, not assumed. Medians, not
    p90s: on a shared CPU a few stalled requests would inflate a tail-based factor until no load
    could break the objectives. Rounded up to two significant digits (round numbers)."""
    ok = run.requests[run.requests.success]
    need = 0.0
    for name, c in workload.class_slos().items():
        rows = ok[ok.label == name]
        for key, bound in c["slo"].items():
            if key in COLUMN and len(rows):
                p50 = 1000 * float(np.nanmedian(rows[COLUMN[key]].to_numpy(float)))
                need = max(need, headroom * p50 / bound)
    digits = 10 ** (math.floor(math.log10(need)) - 1) if need > 0 else 1
    return math.ceil(need / digits) * digits if need > 0 else 1.0


def met(frame, slos: dict) -> pd.Series:
    """Boolean per request: answered and within every bound of its class (``label``)."""
    ok = frame.success if "success" in frame else frame.outcome == "ok"
    out = ok.copy()
    for cls, bounds in slos.items():
        rows = frame.label == cls
        for key, bound in bounds.items():
            v = frame[COLUMN[key]].fillna(0) * 1000        # one-token answers have no TPOT
            out &= ~rows | (v <= bound)
    return out.astype(bool)


# ---- one run, per class ------------------------------------------------------------------------

def itl_ms(frame) -> pd.Series:
    """Every inter-token gap of the answered requests (ms), indexed by class."""
    parts = []
    for _, r in frame[frame.success].iterrows():
        t = np.asarray(r.token_times_s if r.token_times_s is not None else [], float)
        if len(t) > 1:
            parts.append(pd.Series(1000 * np.diff(t), index=[r.label] * (len(t) - 1)))
    return pd.concat(parts) if parts else pd.Series(dtype=float)


def class_table(run, slos: dict) -> pd.DataFrame:
    """Per class: requests, p50 / p90 of TTFT, TPOT, ITL and E2E (ms), median queue time, share
    within its SLO; the run's KV peak, preemptions and failures go with the run, not a class."""
    df, gaps = run.requests, itl_ms(run.requests)
    good = met(df, slos)
    rows = {}
    for cls, part in df.groupby("label"):
        ok = part[part.success]
        row = {"requests": len(part), "failed": int((~part.success).sum())}
        for col, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E")):
            v = 1000 * ok[col].dropna().to_numpy(float)
            row[f"p50 {name}"] = float(np.median(v)) if len(v) else math.nan
            row[f"p90 {name}"] = float(np.percentile(v, 90)) if len(v) else math.nan
        g = gaps[gaps.index == cls].to_numpy(float) if len(gaps) else np.array([])
        row["p90 ITL"] = float(np.percentile(g, 90)) if len(g) else math.nan
        row["p50 queue"] = 1000 * float(ok.queue_s.median()) if len(ok) else math.nan
        row["within SLO"] = float(good[part.index].mean())
        rows[cls] = row
    return pd.DataFrame(rows).T.round(3)


def run_signals(run) -> dict[str, float]:
    """The run-level numbers the bottleneck table reads: throughput, peak KV use, preemptions."""
    df = run.requests
    out_tokens = float(df[df.success].output_tokens.sum())
    return {"requests/s": len(df) / run.duration_s, "output tok/s": out_tokens / run.duration_s,
            "peak KV use": float(run.state.kv_cache_usage.max()) if len(run.state) else math.nan,
            "preemptions": int(df.num_preemptions.fillna(0).sum()),
            "failed": int((~df.success).sum())}


# ---- the sweep ------------------------------------------------------------------------------

def attainment(runs: dict, slos: dict) -> pd.DataFrame:
    """Share of each class within its SLO (columns) at each offered load (index, req/s)."""
    rows = {}
    for rate, run in runs.items():
        good = met(run.requests, slos)
        rows[rate] = good.groupby(run.requests.label).mean()
    t = pd.DataFrame(rows).T
    t.index.name = "offered (req/s)"
    return t.sort_index()


def leaves_slo(table: pd.DataFrame, target: float = 0.9) -> dict[str, float | None]:
    """Per class, the lowest offered load at which fewer than ``target`` of its requests met
    the SLO (None: it held at every load tried)."""
    out = {}
    for cls in table.columns:
        below = table.index[table[cls] < target]
        out[cls] = float(below.min()) if len(below) else None
    return out


# ---- the bottleneck ----------------------------------------------------------------------------

@dataclass
class Signals:
    """What the article's table reads, measured on a light and a heavy run of the same mix."""
    ttft_growth: float          # p90 TTFT heavy / light, all classes
    queue_share: float          # median queue time / median TTFT, heavy run
    prefill_share: float        # median (TTFT - queue) / median TTFT, heavy run
    prompt_ttft_corr: float     # Pearson(prompt tokens, TTFT - queue), heavy run
    peak_kv: float              # fraction of the KV pool, heavy run
    preemptions: int
    ttft_ok: float              # share of heavy-run requests within their TTFT bound
    tpot_ok: float              # ... within their TPOT bound


def signals(light, heavy, slos: dict) -> Signals:
    h, lt = heavy.requests[heavy.requests.success], light.requests[light.requests.success]
    ttft = h.ttft_s.median()
    prefill = (h.ttft_s - h.queue_s).clip(lower=0)
    corr = float(np.corrcoef(h.prompt_tokens, prefill)[0, 1]) if len(h) > 2 else math.nan

    def within(key):
        rows = [h[h.label == c] for c, b in slos.items() if key in b]
        v = pd.concat([1000 * r[COLUMN[key]].fillna(0) <= slos[r.label.iloc[0]][key]
                       for r in rows if len(r)]) if rows else pd.Series(dtype=bool)
        return float(v.mean()) if len(v) else 1.0

    return Signals(ttft_growth=float(h.ttft_s.quantile(0.9) / lt.ttft_s.quantile(0.9)),
                   queue_share=float(h.queue_s.median() / ttft), prefill_share=float(prefill.median() / ttft),
                   prompt_ttft_corr=corr, peak_kv=float(heavy.state.kv_cache_usage.max()),
                   preemptions=int(h.num_preemptions.fillna(0).sum()),
                   ttft_ok=within("ttft"), tpot_ok=within("tpot"))


BOTTLENECKS = {
    "queue": "TTFT rises with queue: offered load exceeds the serving capacity",
    "prefill": "long prompts hurt TTFT: prefill dominates",
    "kv": "KV usage stays high: sequence state limits concurrency",
    "decode": "good TTFT, poor generation: decode or interference dominates",
}


def rule_evidence(s: Signals) -> dict[str, tuple[bool, str]]:
    """Each row of the article's table, applied to the measurements: (holds, the evidence)."""
    return {
        "kv": (s.peak_kv >= 0.9 or s.preemptions > 0,
               f"peak KV use {s.peak_kv:.0%} of the pool, {s.preemptions} preemptions (the rule: 90 % "
               "or any preemption)"),
        "queue": (s.queue_share >= 0.5 and s.ttft_growth >= 1.5,
                  f"queue time is {s.queue_share:.0%} of the median TTFT and p90 TTFT grew "
                  f"{s.ttft_growth:.1f}x from the light to the heavy load (the rule: half and 1.5x)"),
        "prefill": (s.prefill_share >= 0.5 and s.prompt_ttft_corr >= 0.5,
                    f"prefill is {s.prefill_share:.0%} of the median TTFT; its correlation with the "
                    f"prompt length is {s.prompt_ttft_corr:.2f} (the rule: half and 0.5)"),
        "decode": (s.ttft_ok >= 0.9 and s.tpot_ok < 0.9,
                   f"{s.ttft_ok:.0%} of requests met their TTFT bound, {s.tpot_ok:.0%} their TPOT "
                   "bound (the rule: TTFT at least 90 %, TPOT under 90 %)"),
    }


def classify(s: Signals) -> str:
    """The first row of the table that holds, in the order a fix must follow: a full KV pool
    makes everything else queue, a queue hides the prefill, and decode is what is left."""
    ev = rule_evidence(s)
    for name in ("kv", "queue", "prefill", "decode"):
        if ev[name][0]:
            return name
    return "none"


# ---- a noise-aware comparison ------------------------------------------------------------------

def bootstrap_ci(a, b, q: float = 90, n: int = 2000, seed: int = 0, level: float = 0.95):
    """A percentile-bootstrap interval for (the q-th percentile of b) - (that of a), ms."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    rng = np.random.default_rng(seed)
    # All n resamples at once, one row each: one percentile call per side instead of 2n.
    d = (np.percentile(rng.choice(b, (n, len(b))), q, axis=1)
         - np.percentile(rng.choice(a, (n, len(a))), q, axis=1))
    lo, hi = np.percentile(d, [50 * (1 - level), 100 - 50 * (1 - level)])
    return float(lo), float(hi)


def compare(before: list, after: list, cls: str, metric: str = "ttft_s", alpha: float = 0.05) -> dict:
    """Requests of class ``cls`` pooled over the repeats of each configuration: the Mann-Whitney
    U test on the per-request samples and a bootstrap interval of the p90 difference. Verdict
    "better" / "worse" only when both agree the difference is real; else "no clear change"."""
    def pool(runs):
        parts = [r.requests[(r.requests.label == cls) & r.requests.success] for r in runs]
        return np.concatenate([1000 * p[metric].dropna().to_numpy(float) for p in parts])
    a, b = pool(before), pool(after)
    row = {"class": cls, "metric": metric, "n before": len(a), "n after": len(b)}
    if min(len(a), len(b)) < 3:   # no test says anything on two samples
        return {**row, "verdict": "too few requests"}
    test = mann_whitney(a, b)
    lo, hi = bootstrap_ci(a, b)
    verdict = "no clear change"
    if test.p_value < alpha and hi < 0:
        verdict = "better"
    elif test.p_value < alpha and lo > 0:
        verdict = "worse"
    return {**row, "p50 before": float(np.median(a)), "p50 after": float(np.median(b)),
            "p90 before": float(np.percentile(a, 90)), "p90 after": float(np.percentile(b, 90)),
            "p90 change CI": (round(lo, 1), round(hi, 1)), "p (Mann-Whitney)": float(test.p_value),
            "verdict": verdict}


def unclear_causes(row: dict) -> list[str]:
    """Why :func:`compare` gave no verdict, from its own numbers (empty when it gave one): the
    cause a lesson that expected a verdict reports instead of blaming the engine."""
    if row.get("verdict") != "no clear change":
        return []
    lo, hi = row["p90 change CI"]
    n = f"{row['n before']} and {row['n after']} requests"
    if lo <= 0 <= hi:
        return [f"the 95 % interval of the p90 change, {lo:+.0f} to {hi:+.0f} ms over {n}, includes no "
                "change: with this few requests of the class, its spread hides the change (more requests "
                "per run, or more repeats, would tell)"]
    return [f"the rank test (p = {row['p (Mann-Whitney)']:.2g}) finds the {n} alike while the p90 interval "
            f"({lo:+.0f} to {hi:+.0f} ms) excludes no change: the tail moved, the bulk did not"]


# ---- the quality gate, when numerics changed -----------------------------------------------------

# Engine arguments that change the model's numbers (not only its speed): a change of one of them
# is a win only after the quality gate passes on it.
NUMERIC_ARGS = ("quantization", "kv_cache_dtype", "dtype", "model")


def touches_numerics(change_args: dict) -> bool:
    """Whether the one change (engine arguments, e.g. ``{"quantization": "int8"}``) can change a
    token: seats, budgets, chunking, caching and greedy-verified speculation cannot."""
    return any(k in NUMERIC_ARGS for k in change_args)


def gated_win(verdict: str, change_args: dict, run_gate) -> tuple[bool, bool | None]:
    """Step 6 of the method: (is it a win, did the gate pass). ``run_gate()`` runs the quality
    gate and returns whether it passed; it is called only when the change touches numerics
    (otherwise the gate's answer is None: not needed). A failed gate blocks the win whatever
    the latency verdict; a win needs the verdict "better"."""
    gate_passed = bool(run_gate()) if touches_numerics(change_args) else None
    return verdict == "better" and gate_passed is not False, gate_passed


# ---- the run's manifest -------------------------------------------------------------------------

def manifest(llm, workload, run, **bench) -> dict:
    """The bench's run manifest (minserve/bench/manifest.py) for an in-process lab run: workload
    name, version and hashes, model file hashes, code and kernel build, hardware, the engine's
    whole configuration and the machine's load during the run."""
    from minserve.bench.manifest import build_manifest, config_dict
    from minserve.lab.target import RemoteLLM
    load = run.load.as_dict() if getattr(run, "load", None) is not None else None
    if isinstance(llm, RemoteLLM):   # the lab's target: its configuration is the server's to tell
        return build_manifest(workload=workload.describe(), model=llm.model, engine=None,
                              server={"kind": "lab target (lab 08)", "base_url": llm.base_url},
                              bench={**run.settings, **bench}, load=load)
    engine = llm.llm_engine
    return build_manifest(workload=workload.describe(), model=engine.config.model,
                          engine=config_dict(engine.config), server={"kind": "in-process (lab 08)"},
                          bench={**run.settings, **bench}, load=load)
