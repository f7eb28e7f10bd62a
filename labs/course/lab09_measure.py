"""Lab 09 (release gates): result sets of repeated in-process runs, the naive threshold's false
alarms, the small quality eval the gate reads, and the canary drive.

Every function returns what a run measured (BenchResults, per-run values, eval rows, a timeline
frame); the notebook judges them with :mod:`minserve.bench.compare` and :mod:`minserve.bench.gate`,
which are the code under study, and the checks in :mod:`course.lab09` are built from the same
values.
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from minserve.bench.compare_runs import run_from, run_metrics
from minserve.bench.inprocess import run_inprocess
from minserve.engine.observers import PlantedSlowdown

NAIVE_THRESHOLD = 0.05   # "fail the build if the metric moved 5 %": one run against one run


def result_set(engine, requests, repeats: int, *, slowdown: float = 0.0, workload=None,
               class_slos=None, max_concurrency: int = 4, seed0: int = 0) -> list:
    """``repeats`` in-process runs of the same requests on ``engine`` (BenchResults, manifests
    included), with a :class:`PlantedSlowdown` of ``slowdown`` on every step when it is > 0.
    The seeds differ per run (``seed0 + k``) only in the arrival draw, which an unlimited rate
    does not use: the runs repeat one configuration."""
    obs = PlantedSlowdown(slowdown) if slowdown > 0 else None
    if obs is not None:
        engine.add_step_observer(obs)
    try:
        return [run_inprocess(engine, requests, max_concurrency=max_concurrency, ignore_eos=True,
                              seed=seed0 + k, workload=workload, class_slos=class_slos,
                              disable_tqdm=True) for k in range(repeats)]
    finally:
        if obs is not None:
            engine.remove_step_observer(obs)


def per_run(results, metric: str = "p50_tpot_ms", cls: str = "all") -> np.ndarray:
    """One number per run, as bench compare reduces a run (``run_metrics``)."""
    return np.array([run_metrics(run_from(r))[(cls, metric)] for r in results], dtype=float)


def naive_false_alarms(values, threshold: float = NAIVE_THRESHOLD) -> tuple[int, int]:
    """(pairs flagged, pairs): over every pair of runs of the *same* build, how many a rule
    "one run against one run, fail if it moved by more than ``threshold``" would call a change.
    The later run of a pair is the candidate (``b / a - 1``)."""
    pairs = list(itertools.combinations(np.asarray(values, float), 2))
    flagged = sum(abs(b / a - 1) > threshold for a, b in pairs)
    return int(flagged), len(pairs)


def eval_rows(ref_llm, llm, fmt: str, num_texts: int, num_questions: int) -> list[dict]:
    """Rows as ``minserve eval --json`` writes them (fp32 first, then ``fmt``), measured with its
    own metric functions on a slice of its data: perplexity and mean KL on the first ``num_texts``
    paragraphs, exact match on the first ``num_questions`` questions (greedy agreement, which the
    gate does not read, is left out to keep the slice quick)."""
    from minserve.eval import metrics
    from minserve.eval.data import load_questions, load_texts
    from minserve.eval.gate import parse_format
    texts, questions = load_texts()[:num_texts], load_questions()[:num_questions]
    rows = []
    for label, engine in (("fp32", ref_llm), (fmt, llm)):
        spec = parse_format(label)
        rows.append({"format": label, "quantization": spec.quantization, "engine_args": spec.engine_args,
                     "weight_bytes": engine.llm_engine.runner.weight_bytes(),
                     "perplexity": metrics.perplexity(engine, texts).value,
                     "mean_kl": 0.0 if engine is ref_llm else metrics.mean_kl(ref_llm, engine, texts),
                     "exact_match": metrics.exact_match(engine, questions).accuracy, "error": None})
    return rows


def ppl_increase_pct(rows: list[dict]) -> float:
    """The candidate's perplexity over the reference's, as a % increase (the gate's measure)."""
    return 100 * (rows[1]["perplexity"] / rows[0]["perplexity"] - 1)


# ---- the canary --------------------------------------------------------------------------------

def drive_canary(client, body: dict, limit: int, after_rollback: int = 6):
    """Send ``body`` one request at a time until the canary rolls back (then ``after_rollback``
    more, to see where they go), reading ``GET /routes`` after each. Returns a frame: one row per
    request (its route, the decision header's reason, E2E seconds, the canary's state and both
    routes' recent p50 TPOT)."""
    import pandas as pd
    rows, left = [], None
    t0 = time.perf_counter()
    for i in range(limit):
        t = time.perf_counter()
        r = client.post("/v1/completions", json=body)
        e2e = time.perf_counter() - t
        view = client.get("/routes").json()
        recent = {n: v.get("recent", {}) for n, v in view["routes"].items()}
        reason = r.headers.get("x-minserve-decision", "").split(";")[0].removeprefix("reason=")
        rows.append({"request": i, "t_s": time.perf_counter() - t0, "status": r.status_code,
                     "route": r.headers.get("x-minserve-route"), "reason": reason, "e2e_s": e2e,
                     "state": view["canary"]["state"],
                     **{f"{n}_tpot_p50_s": rec.get("tpot_p50_s") for n, rec in recent.items()}})
        if left is None and view["canary"]["state"] == "rolled_back":
            left = after_rollback
        if left is not None:
            left -= 1
            if left < 0:
                break
    frame = pd.DataFrame(rows)
    if "canary_tpot_p50_s" in frame and "stable_tpot_p50_s" in frame:
        frame["tpot_ratio"] = frame.canary_tpot_p50_s / frame.stable_tpot_p50_s
    return frame


def rollback_decision(view: dict) -> dict | None:
    """The canary's rollback decision in ``GET /routes`` (None if it did not roll back)."""
    return next((d for d in view["canary"]["decisions"] if d["decision"] == "rollback"), None)


def gate_summary(g, shown: int = 3) -> str:
    """The gate's two verdicts and its decision, each verdict with its first ``shown`` reasons
    (the full list is ``g.report()``)."""
    lines = []
    for name, v in (("performance", g.performance), ("quality", g.quality)):
        lines.append(f"{name} verdict: {v.status}")
        lines += [f"  - {r}" for r in v.reasons[:shown]]
        if len(v.reasons) > shown:
            lines.append(f"  - ... and {len(v.reasons) - shown} more (g.report() lists them all)")
    lines.append(f"decision: {g.decision} (exit {g.exit_code})")
    return "\n".join(lines)
