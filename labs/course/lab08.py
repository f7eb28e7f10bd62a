"""Lab 08 (the optimization lab): the exercises' checks. Measurements and drills live in
:mod:`course.lab08_measure` and :mod:`course.lab08_drills`; every check here is built from a
run's own frames, so what it accepts is what this run measured."""

from __future__ import annotations

import math
import numbers

import numpy as np

from minserve.lab.checks import ChoiceCheck, Mistake, NumberCheck
from course.lab08_measure import BOTTLENECKS, classify, rule_evidence


def q1_most_prompt_tokens(shapes) -> ChoiceCheck:
    """Which class of the mix sends the most prompt tokens (shared prefix + body) in total?
    ``shapes``: the frame of ``Workload.shapes`` (one row per request, no text)."""
    tokens = (shapes.prefix_tokens + shapes.body_tokens).groupby(shapes.workload).sum()
    counts = shapes.workload.value_counts()
    truth = str(tokens.idxmax())
    most_requests = str(counts.idxmax())
    options = {}
    for cls in tokens.index:
        line = (f"{cls}: {int(counts[cls])} requests, {int(tokens[cls])} prompt tokens "
                f"({tokens[cls] / tokens.sum():.0%} of the prefill work).")
        if cls == most_requests and cls != truth:
            line += " It sends the most requests, but the question is about tokens: requests differ in length."
        options[cls] = line
    return ChoiceCheck(
        "Exercise 1", truth, options=options,
        hint="add prefix_tokens and body_tokens per request, then sum per workload.",
        solution='answer = (shapes.prefix_tokens + shapes.body_tokens).groupby(shapes.workload).sum().idxmax()',
        namespace=lambda: {"shapes": shapes})


def q2_p90_ttft(requests, cls: str) -> NumberCheck:
    """p90 TTFT (ms) of class ``cls`` in the baseline run (``requests``: RunResult.requests)."""
    ok = requests[requests.success]
    part = ok[ok.label == cls]
    v = 1000 * part.ttft_s.to_numpy(float)
    e = float(np.percentile(v, 90))
    return NumberCheck(
        "Exercise 2", e, unit="ms", rel_tol=0.02, abs_tol=1.0,
        tolerance_why="rounding; numpy's default percentile interpolation",
        hint=f"keep the answered requests of class {cls!r}, take their ttft_s, in ms, at the 90th percentile.",
        solution=f'ok = base.requests.query("success and label == {cls!r}")\n'
                 'answer = 1000 * ok.ttft_s.quantile(0.9)',
        namespace=lambda: {"base": type("R", (), {"requests": requests})()},
        explanation="One class's tail is what its users feel; the mix's tail mixes every class's.",
        mistakes=[
            Mistake("that is the median (p50): the objective is judged on the tail.",
                    value=float(np.median(v)), rel_tol=0.02),
            Mistake("that is the p90 over every class of the mix; the question asks for one class.",
                    value=1000 * float(ok.ttft_s.quantile(0.9)), rel_tol=0.02),
            Mistake("that is the end-to-end latency (E2E), not the time to the first token.",
                    value=1000 * float(part.e2e_s.quantile(0.9)), rel_tol=0.02),
            Mistake("that is the queue time alone; TTFT adds the prefill to it.",
                    value=1000 * float(part.queue_s.quantile(0.9)), rel_tol=0.02),
        ])


class _LoadChoice(ChoiceCheck):
    """A ChoiceCheck whose options are offered loads: a number answer is read as ``f"{x:g}"``."""

    def compare(self, answer, expected):
        if isinstance(answer, numbers.Number) and not isinstance(answer, bool):
            answer = f"{float(answer):g}"
        if answer is None or (isinstance(answer, str) and answer.strip().lower() in ("none", "never")):
            answer = "never"
        return super().compare(answer, expected)


def q3_leaves_slo(table, cls: str, target: float = 0.9) -> ChoiceCheck:
    """The lowest offered load at which class ``cls`` drops below ``target`` within its SLO
    (``table``: :func:`~course.lab08_measure.attainment`); "never" if it held everywhere."""
    col = table[cls]
    below = [r for r in table.index if col[r] < target]
    truth = f"{min(below):g}" if below else "never"
    options = {}
    for r in table.index:
        share = f"{col[r]:.0%} of {cls} requests met the SLO at {r:g} req/s"
        if col[r] >= target:
            options[f"{r:g}"] = f"{share}: it still held there."
        elif f"{r:g}" == truth:
            options[f"{r:g}"] = f"{share}, the first load below {target:.0%}."
        else:
            options[f"{r:g}"] = f"{share}, but it had already dropped below {target:.0%} at a lower load."
    options["never"] = (f"it held at every load tried (lowest share {col.min():.0%})." if not below else
                        f"at {truth} req/s only {col[float(truth)]:.0%} met the SLO.")
    return _LoadChoice(
        "Exercise 3", truth, options=options,
        hint=f"read the {cls} column of the attainment table from the top: the first row under {target:.0%}.",
        solution=f"below = table.index[table[{cls!r}] < {target}]\n"
                 'answer = f"{below.min():g}" if len(below) else "never"',
        namespace=lambda: {"table": table})


def q4_bottleneck(sig) -> ChoiceCheck:
    """Name the bottleneck (a key of BOTTLENECKS, or "none"); the check applies the table."""
    ev = rule_evidence(sig)
    truth = classify(sig)
    options = {}
    for key, text in BOTTLENECKS.items():
        holds, why = ev[key]
        options[key] = f"{text}. Measured: {why}: {'it holds' if holds else 'it does not hold'}."
    order = ("kv", "queue", "prefill", "decode")
    if truth != "none":
        first = order.index(truth)
        for key in order[first + 1:]:
            if ev[key][0]:
                options[key] += f" It holds too, but {truth!r} comes first: fix it and this one may go away."
    options["none"] = "no row of the table holds on these measurements." if truth == "none" else (
        f"the {truth!r} row holds: {ev[truth][1]}.")
    return ChoiceCheck(
        "Exercise 4", truth, options=options,
        hint="look at the signals table: queue share of TTFT and TTFT growth, prefill share and its "
             "correlation with prompt length, peak KV use and preemptions, TTFT and TPOT attainment.",
        solution="answer = classify(sig)  # the table's rows, in order (course/lab08_measure.py)",
        namespace=lambda: {"sig": sig, "classify": classify})


def q5_verdict(row: dict) -> ChoiceCheck:
    """Did the change help class ``row["class"]``? ``row``: :func:`~course.lab08_measure.compare`."""
    truth = row["verdict"]
    if truth == "too few requests":   # no statistics to quote: the only right answer says so
        why = f"{row['n before']} and {row['n after']} answered requests: no test can tell a difference on that."
        return ChoiceCheck("Exercise 5", truth, options={"better": why, "worse": why, "no clear change": why,
                                                         "too few requests": why},
                           hint="look at the sample sizes in the comparison row.",
                           solution='answer = row["verdict"]', namespace=lambda: {"row": row})
    lo, hi = row["p90 change CI"]
    stats = (f"{row['n before']} vs {row['n after']} requests, Mann-Whitney p = {row['p (Mann-Whitney)']:.3g}, "
             f"95 % interval of the p90 change [{lo:g}, {hi:g}] ms")
    naive = "better" if row["p50 after"] < row["p50 before"] else "worse"
    options = {
        "better": f"{stats}. 'better' needs p < 0.05 and the whole interval below zero.",
        "worse": f"{stats}. 'worse' needs p < 0.05 and the whole interval above zero.",
        "no clear change": f"{stats}. Either the test or the interval cannot rule out noise.",
    }
    if truth == "no clear change":
        options[naive] += (f" The median moved ({row['p50 before']:.0f} -> {row['p50 after']:.0f} ms), "
                           "but a move this size is within what repeats of one setting differ by.")
    return ChoiceCheck(
        "Exercise 5", truth, options=options,
        hint="read the comparison row: the p-value and the interval, not the two medians.",
        solution='answer = row["verdict"]', namespace=lambda: {"row": row})


def q6_lost(report) -> NumberCheck:
    """How many requests of the restart drill got no answer (``report``: RestartReport)?"""
    o = report.outcomes
    refused = int(o[o.status == 0].requests.sum())
    cut = int(o[(o.status != 0) & (o.outcome != "ok")].requests.sum())
    mistakes = []
    if cut:
        mistakes.append(Mistake(f"that counts only the connections refused while it was down; the "
                                f"{cut} requests in flight at the stop were cut off too.", value=refused, rel_tol=0))
    if refused:
        mistakes.append(Mistake(f"that counts only the requests cut off at the stop; {refused} more found "
                                "no server at all (connection refused).", value=cut, rel_tol=0))
    if report.retried_ok:
        mistakes.append(Mistake("that is after the retry: the question is what the clients lost "
                                "before anyone sent again.", value=report.lost - report.retried_ok, rel_tol=0))
    return NumberCheck(
        "Exercise 6", report.lost, unit="requests", integer=True,
        hint="every row of the outcome table that is not 'ok', whatever its status.",
        solution='o = drill.outcomes\nanswer = int(o[o.outcome != "ok"].requests.sum())',
        namespace=lambda: {"drill": report},
        explanation="A restart costs the requests in flight and those that arrive while it is down; "
                    "a client that retries (idempotent completions) gets most of them back.",
        mistakes=mistakes)


def q7_ttft_growth(calm, mixed) -> NumberCheck:
    """By what factor did the other classes' p90 TTFT grow with long requests mixed in?
    ``calm`` / ``mixed``: the drill's two runs (RunResult; the long ones are labelled "long")."""
    from course.lab08_stress import LONG

    def p90(frame, col="ttft_s"):
        return 1000 * float(frame[frame.success][col].quantile(0.9))
    c, m = (r.requests[r.requests.label != LONG] for r in (calm, mixed))
    e = p90(m) / p90(c)
    mistakes = [
        Mistake("that counts the long requests themselves: the question is what they cost "
                "the others.", value=p90(mixed.requests) / p90(c), rel_tol=0.03),
        Mistake("that is the ratio of the medians: the tail is what the objective judges.",
                value=float(m[m.success].ttft_s.median() / c[c.success].ttft_s.median()), rel_tol=0.03),
        Mistake("that is the difference in ms; the question asks for the factor (mixed / calm).",
                value=p90(m) - p90(c), rel_tol=0.03),
        Mistake("that is calm / mixed, upside down.", value=p90(c) / p90(m), rel_tol=0.03)]
    # A mistake whose number is the right one's (within the tolerance) would reject a right answer.
    mistakes = [x for x in mistakes if not math.isclose(x.value, e, rel_tol=0.03, abs_tol=0.02)]
    return NumberCheck(
        "Exercise 7", e, unit="x", rel_tol=0.03, abs_tol=0.02,
        tolerance_why="rounding to two digits",
        hint="the answered requests that are not labelled 'long', p90 of ttft_s in each run, "
             "then mixed / calm.",
        solution='def p90(run):\n    ok = run.requests.query("success and label != \'long\'")\n'
                 '    return ok.ttft_s.quantile(0.9)\nanswer = p90(mixed) / p90(calm)',
        namespace=lambda: {"calm": calm, "mixed": mixed},
        explanation="A long prompt's prefill takes the step budget that other requests' first "
                    "tokens wait for, and a long answer holds a seat and KV blocks the whole time.",
        mistakes=mistakes)
