"""Lab 09 (release gates): the exercises' checks. Each is built from this run's own values (per-run
numbers, the gate's verdicts, the eval rows, the canary's decision), so what it accepts is what
this run measured. Measurements live in :mod:`course.lab09_measure`."""

from __future__ import annotations

import numbers

from minserve.lab.checks import ChoiceCheck, Mistake, NumberCheck
from course.lab09_measure import NAIVE_THRESHOLD, naive_false_alarms


def q1_naive_share(values) -> NumberCheck:
    """Share (0 to 1) of the pairs of same-build runs whose p50 TPOT differs by more than 5 %
    (``values``: one p50 TPOT per run, ms)."""
    flagged, pairs = naive_false_alarms(values)
    at_10, _ = naive_false_alarms(values, 2 * NAIVE_THRESHOLD)
    share = flagged / pairs
    return NumberCheck(
        "Exercise 1", share, rel_tol=0.0, abs_tol=0.5 / pairs,
        tolerance_why=f"one pair of {pairs} is {1 / pairs:.3f}; half of it for rounding",
        hint="for every pair (a, b) of runs (itertools.combinations), is abs(b / a - 1) > 0.05? "
             "Count those and divide by the number of pairs.",
        solution="import itertools\n"
                 "pairs = list(itertools.combinations(same_tpot, 2))\n"
                 "answer = sum(abs(b / a - 1) > 0.05 for a, b in pairs) / len(pairs)",
        namespace=lambda: {"same_tpot": list(values)},
        explanation="Every one of those pairs is the same build: each flag is a false alarm.",
        mistakes=[
            Mistake("that is the count of flagged pairs; the question asks for their share (0 to 1).",
                    test=lambda a: flagged > 1 and isinstance(a, numbers.Number) and float(a) == flagged),
            Mistake("that reads like a percentage; give the share as a fraction (0.25, not 25).",
                    test=lambda a: isinstance(a, numbers.Number) and float(a) > 1 and
                    abs(float(a) - 100 * share) <= 50 / pairs),
            Mistake("that is the share beyond 10 %; the naive rule in the question is 5 %.",
                    value=at_10 / pairs, rel_tol=1e-9),
        ])


VERDICTS = ("performance", "quality", "both", "neither")


def _which(gate) -> str:
    perf, qual = gate.performance.status == "fail", gate.quality.status == "fail"
    return {(True, True): "both", (True, False): "performance", (False, True): "quality"}.get(
        (perf, qual), "neither")


def q_which_gate(name: str, gate, candidate: str) -> ChoiceCheck:
    """Which verdict failed the candidate (``gate``: a :class:`~minserve.bench.gate.GateResult`)."""
    truth = _which(gate)
    perf, qual = gate.performance, gate.quality
    options = {
        "performance": f"the performance verdict is {perf.status!r}"
                       + (f": {perf.reasons[0]}" if perf.reasons else "") + ".",
        "quality": f"the quality verdict is {qual.status!r}" + (f": {qual.reasons[0]}" if qual.reasons else "") + ".",
        "both": f"performance {perf.status!r}, quality {qual.status!r}: read each verdict apart.",
        "neither": f"the decision is {gate.decision!r}; performance {perf.status!r}, quality {qual.status!r}.",
    }
    return ChoiceCheck(
        name, truth, options=options,
        hint=f"read the {candidate} gate's performance.status and quality.status: which one is 'fail'?",
        solution=f"g = gates[{candidate!r}]\n"
                 "fails = {'performance': g.performance.status == 'fail', 'quality': g.quality.status == 'fail'}\n"
                 "answer = ('both' if all(fails.values()) else next((k for k, v in fails.items() if v), 'neither'))",
        namespace=lambda: {"gates": {candidate: gate}},
        explanation="The two verdicts are kept apart so the reason for a reject names the right owner.")


def q3_ppl_increase(rows: list[dict]) -> NumberCheck:
    """The candidate's perplexity increase over fp32, in % (``rows``: eval rows, fp32 first)."""
    ref, cand = rows[0]["perplexity"], rows[1]["perplexity"]
    pct = 100 * (cand / ref - 1)
    return NumberCheck(
        "Exercise 3", pct, unit="%", rel_tol=0.01, abs_tol=0.05,
        tolerance_why="rounding of the printed perplexities",
        hint="candidate perplexity / fp32 perplexity - 1, times 100.",
        solution="answer = 100 * (eval_rows[1]['perplexity'] / eval_rows[0]['perplexity'] - 1)",
        namespace=lambda: {"eval_rows": rows},
        explanation="The floor is written in the same unit: policy['quality']['int4']['max_ppl_increase'].",
        mistakes=[
            Mistake("that is the ratio of the perplexities; the increase is ratio - 1, in %.", value=cand / ref),
            Mistake("that is the increase as a fraction; the question asks for %.", value=cand / ref - 1),
            Mistake("that is upside down (fp32 over the candidate).", value=100 * (ref / cand - 1)),
            Mistake("that is the difference in perplexity points, not a relative increase.", value=cand - ref),
        ])


def q5_rollback_ratio(decision: dict) -> NumberCheck:
    """The canary's p50 TPOT over the stable route's in the rollback decision's evidence."""
    ev = decision["evidence"]
    cand, base = ev["candidate"]["tpot_p50_s"], ev["baseline"]["tpot_p50_s"]
    limit = ev["criteria"]["max_tpot_p50_ratio"]
    e2e = ev["candidate"]["e2e_p90_s"] / ev["baseline"]["e2e_p90_s"]
    return NumberCheck(
        "Exercise 5", cand / base, rel_tol=0.01,
        tolerance_why="rounding of the evidence's seconds",
        hint="decision['evidence'] holds both windows: the candidate's tpot_p50_s over the baseline's.",
        solution="ev = decision['evidence']\n"
                 "answer = ev['candidate']['tpot_p50_s'] / ev['baseline']['tpot_p50_s']",
        namespace=lambda: {"decision": decision},
        explanation="The rollback compared the two routes' recent windows, both measured while they served.",
        mistakes=[
            Mistake("that is upside down: the stable route's over the canary's.", value=base / cand),
            Mistake("that is the criterion's limit, declared before the canary started, not what was observed.",
                    value=limit, rel_tol=1e-9),
            Mistake("that is the E2E p90 ratio; the criterion that broke is about TPOT at p50.", value=e2e),
        ])
