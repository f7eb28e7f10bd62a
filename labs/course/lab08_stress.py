"""Lab 08's drills on the server's resources: **long requests** mixed into steady traffic (what
do they cost the other classes' TTFT and ITL?) and the **KV budget cut by a restart** (what did
``/metrics`` show: KV use, preemptions, waiting requests, and did the objectives hold?).

Both read :class:`~minserve.lab.workload.RunResult` runs that ``lab.run_workload(base_url=...)``
made over HTTP: per-request latencies as the client saw them (``requests``) and the server's
gauges as its ``/metrics`` showed them twice a second (``state``: ``num_waiting``,
``kv_cache_usage``, ``num_preemptions`` counted from the run's first sample)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import numpy as np
import pandas as pd

from course.lab08_measure import compare, met

LONG = "long"        # the label of the long requests, kept apart from the mix's four classes
NEAR_FULL = 0.8      # KV use at which a pool counts as at its top (kv_cut_report)


# ---- long requests ------------------------------------------------------------------------------

def long_requests(workload, tokenizer, scales: dict[str, float], *, seed: int) -> list:
    """One request of each of the mix's classes in ``scales`` (class -> length scale: rag brings
    long retrieved context, codegen long answers), labelled ``"long"`` so the other classes'
    numbers stay their own."""
    parts = workload.classes()
    out = []
    for k, (cls, scale) in enumerate(scales.items()):
        one = parts[cls].requests(tokenizer, 1, seed=seed + k, length_scale=scale)[0]
        out.append(replace(one, request_id=f"long-{k}", scenario=LONG))
    return out


def mix_in(steady: list, extra: list) -> list:
    """``steady`` with ``extra`` spread evenly through it (arrivals follow the list's order)."""
    out = list(steady)
    for k, r in enumerate(extra):
        out.insert(round((k + 1) * len(steady) / (len(extra) + 1)) + k, r)
    return out


def _others(run) -> SimpleNamespace:
    """The run's requests of every class but the long ones, as one class ("others")."""
    df = run.requests[run.requests.label != LONG].assign(label="others")
    return SimpleNamespace(requests=df)


def _p90(frame, col: str) -> float:
    v = 1000 * frame[frame.success][col].dropna().to_numpy(float)
    return float(np.percentile(v, 90)) if len(v) else math.nan


def _peak(state, col: str) -> float:
    return float(state[col].max()) if len(state) and state[col].notna().any() else math.nan


@dataclass
class LongReport:
    table: pd.DataFrame          # per class (and "others"): p90 TTFT and TPOT, calm vs mixed, ms
    ttft_growth: float           # others' p90 TTFT, mixed / calm
    tpot_growth: float           # others' p90 TPOT (mean ITL per request), mixed / calm
    ttft: dict = field(repr=False, default_factory=dict)   # lab08_measure.compare's row for TTFT
    peaks: dict = field(default_factory=dict)              # /metrics peaks, calm vs mixed


def long_report(calm, mixed, slos: dict) -> LongReport:
    """Compare the other classes' latencies without (``calm``) and with (``mixed``) the long
    requests; the same steady requests in both runs, at the same rate."""
    rows = {}
    for cls in sorted(set(calm.requests.label) - {LONG}) + ["others"]:
        c = _others(calm).requests if cls == "others" else calm.requests[calm.requests.label == cls]
        m = _others(mixed).requests if cls == "others" else mixed.requests[mixed.requests.label == cls]
        rows[cls] = {"p90 TTFT calm": _p90(c, "ttft_s"), "p90 TTFT mixed": _p90(m, "ttft_s"),
                     "p90 TPOT calm": _p90(c, "tpot_s"), "p90 TPOT mixed": _p90(m, "tpot_s"),
                     "within SLO calm": float(met(c, slos).mean()), "within SLO mixed": float(met(m, slos).mean())}
    table = pd.DataFrame(rows).T.round(3)
    o = table.loc["others"]
    peaks = {k: {"calm": _peak(calm.state, col), "mixed": _peak(mixed.state, col)}
             for k, col in (("peak KV use", "kv_cache_usage"), ("peak waiting", "num_waiting"),
                            ("peak running", "num_running"))}
    return LongReport(table, float(o["p90 TTFT mixed"] / o["p90 TTFT calm"]),
                      float(o["p90 TPOT mixed"] / o["p90 TPOT calm"]),
                      compare([_others(calm)], [_others(mixed)], "others", "ttft_s"), peaks)


# ---- the KV budget cut by a restart ------------------------------------------------------------

def cut_kv_blocks(requests, block_size: int) -> int:
    """A KV pool that still holds the longest request (prompt and answer) with one block to spare,
    and no more: the seats stay, but far fewer requests' state fits at once."""
    longest = max(r.prompt_len + r.expected_output_len for r in requests)
    return math.ceil(longest / block_size) + 1


@dataclass
class KVCutReport:
    table: pd.DataFrame          # what /metrics and the clients showed, full pool vs cut pool
    observable: bool             # the cut showed in /metrics: KV use near full, preemptions or a queue
    held: bool                   # the cut run kept at least ``target`` of its requests within SLO
    target: float = 0.9


def kv_cut_report(full, cut, slos: dict, target: float = 0.9) -> KVCutReport:
    """The same steady traffic before (``full``) and after (``cut``) a restart with a smaller KV
    pool: the server's gauges and what the clients saw."""
    def col(run):
        st, df = run.state, run.requests
        return {"peak KV use": _peak(st, "kv_cache_usage"),
                "preemptions": _peak(st, "num_preemptions"),
                "peak waiting": _peak(st, "num_waiting"),
                "p90 TTFT (ms)": _p90(df, "ttft_s"), "p90 E2E (ms)": _p90(df, "e2e_s"),
                "within SLO": float(met(df, slos).mean()), "failed": int((~df.success).sum())}
    table = pd.DataFrame({"full KV pool": col(full), "cut KV pool": col(cut)})
    f, c = table["full KV pool"], table["cut KV pool"]
    # "Near the top": /metrics is sampled twice a second, so the very peak between samples is missed.
    observable = bool(c["peak KV use"] >= NEAR_FULL or c["preemptions"] > 0 or c["peak waiting"] > f["peak waiting"])
    return KVCutReport(table, observable, bool(c["within SLO"] >= target), target)
