"""Lab 07 (overload and goodput): goodput vs throughput, the knee, the deadline model, classes."""

from __future__ import annotations

import math
import numbers

from minserve.lab.checks import Check, ChoiceCheck, Mistake, NumberCheck, _fmt


def q1_goodput(table, rate) -> NumberCheck:
    """Goodput (req/s within the SLO) at offered load ``rate`` without admission control;
    ``table``: the sweep table (index: offered req/s; columns goodput / throughput / good)."""
    row = table.loc[rate]
    g, thr = float(row["goodput (req/s)"]), float(row["throughput (req/s)"])
    good, answered, dur = int(row["good"]), int(row["answered"]), float(row["duration (s)"])
    mistakes = [
        Mistake(f"that is the raw throughput: every answered request per second. Goodput counts "
                f"only the {good} of {answered} answers that met the objective.", value=thr,
                rel_tol=0.03),
        Mistake("that is the offered load, what the clients sent; goodput is what came back in "
                "time.", value=float(rate), rel_tol=0.03),
        Mistake(f"that is a count of requests; goodput is a rate: divide by the run's duration "
                f"({dur:.1f} s).", value=good, rel_tol=0.0),
    ]
    if answered:
        mistakes.append(Mistake("that is the share of answers that met the objective; goodput is "
                                "those answers per second.", value=good / answered, rel_tol=0.03))
    return NumberCheck(
        "Exercise 1", g, unit="req/s", abs_tol=0.02, rel_tol=0.03,
        tolerance_why="the table rounds to two decimals",
        hint="goodput = requests that met the SLO (both TTFT and TPOT) / the run's duration. The "
             "table has the count of good requests and the duration.",
        solution=f"row = sweep.loc[{float(rate)!r}]\n"
                 'answer = row["good"] / row["duration (s)"]',
        namespace=lambda: {"sweep": table},
        explanation="Past the knee the server stays busy (throughput holds) while a growing share "
                    "of its answers arrive too late to count.",
        mistakes=mistakes)


class KneeCheck(Check):
    """The offered load at which goodput peaks (the knee). Loads whose goodput is within
    ``within`` of the best are accepted too: on a shared CPU neighbouring points can trade
    places from run to run."""

    def __init__(self, name, rates, goodput, throughput, *, within: float = 0.1, **kw):
        self.rates = [float(r) for r in rates]
        self.goodput = [float(g) for g in goodput]
        self.throughput = [float(t) for t in throughput]
        self.within = within
        best = max(range(len(self.rates)), key=lambda k: self.goodput[k])
        super().__init__(name, self.rates[best], **kw)

    def compare(self, answer, expected):
        if isinstance(answer, bool) or not isinstance(answer, numbers.Number) or not math.isfinite(answer):
            return False, f"the answer should be one of the offered loads in req/s, got {answer!r}."
        close = [k for k, r in enumerate(self.rates) if math.isclose(r, float(answer), rel_tol=0.03)]
        if not close:
            return False, (f"{_fmt(answer)} req/s is not one of the offered loads "
                           f"({', '.join(_fmt(round(r, 2)) for r in self.rates)}); pick the one read "
                           "off the plot.")
        k = close[0]
        best_g = max(self.goodput)
        g = self.goodput[k]
        if g >= (1 - self.within) * best_g:
            note = ("" if math.isclose(self.rates[k], expected, rel_tol=1e-9) else
                    f" (goodput there, {_fmt(round(g, 2))} req/s, is within {self.within:.0%} of the "
                    f"best, {_fmt(round(best_g, 2))} req/s at {_fmt(round(expected, 2))} req/s: on "
                    "this run the curve is flat between them)")
            return True, (f"{_fmt(round(self.rates[k], 2))} req/s{note}. Beyond it, more offered "
                          "load buys no more goodput: the extra requests only wait.")
        thr_best = self.rates[max(range(len(self.rates)), key=lambda j: self.throughput[j])]
        if math.isclose(self.rates[k], thr_best, rel_tol=1e-9):
            return False, (f"raw throughput is highest at {_fmt(round(thr_best, 2))} req/s, but "
                           f"goodput there is only {_fmt(round(g, 2))} req/s: the server is busy "
                           "with answers that come too late. The knee is where goodput stops "
                           "rising.")
        side = "past" if self.rates[k] > expected else "before"
        return False, (f"at {_fmt(round(self.rates[k], 2))} req/s goodput is "
                       f"{_fmt(round(g, 2))} req/s, {side} its peak of {_fmt(round(best_g, 2))} "
                       f"req/s. Hint: {self.hint_text}")


def q2_knee(table) -> KneeCheck:
    return KneeCheck(
        "Exercise 2", table.index, table["goodput (req/s)"], table["throughput (req/s)"],
        hint="on the goodput curve, find the offered load after which it stops rising (or falls).",
        solution='answer = sweep["goodput (req/s)"].idxmax()',
        namespace=lambda: {"sweep": table})


def q3_deadline_prediction(prompt_tokens: int, max_tokens: int, p_s_per_token: float,
                           d_s_per_step: float, predicted_s: float) -> NumberCheck:
    """Admission's predicted completion (ms) of one request on an idle server."""
    P, N, p, d = prompt_tokens, max_tokens, p_s_per_token, d_s_per_step
    return NumberCheck(
        "Exercise 3", 1000 * predicted_s, unit="ms", rel_tol=0.01, abs_tol=0.5,
        tolerance_why="rounding the two rates to three significant digits moves the result by "
                      "less than 1 %",
        hint="on an idle server nothing is ahead, so the start is 0; then the model adds the "
             "request's own prefill (P tokens at p seconds each) and its decode (N steps at d "
             "seconds each, counted at max_tokens).",
        solution="answer = 1000 * (P * p + N * d)",
        namespace={"P": P, "N": N, "p": p, "d": d},
        explanation="Output is counted at max_tokens, the only bound known in advance, so the "
                    "prediction is pessimistic for answers that stop early: a tight deadline "
                    "needs a tight max_tokens.",
        mistakes=[
            Mistake("that is the prefill alone; the deadline covers the whole answer, so the "
                    "decode steps count too.", value=1000 * P * p, rel_tol=0.01),
            Mistake("that is the decode alone; the prompt has to be prefilled first.",
                    value=1000 * N * d, rel_tol=0.01),
            Mistake("one decode step short: the model charges a step for each of the max_tokens "
                    "(it does not give the first token to the prefill).",
                    value=1000 * (P * p + (N - 1) * d), rel_tol=0.003),
        ])


def q4_shed_class(counts) -> ChoiceCheck:
    """Which class did per-class budgets shed during the batch flood? ``counts``: the flood run's
    crosstab (label x outcome)."""
    shed = {c: int(counts.loc[c, "shed"]) if "shed" in counts.columns and c in counts.index else 0
            for c in ("interactive", "batch")}
    truth = ("both" if all(shed.values()) else "batch" if shed["batch"] else
             "interactive" if shed["interactive"] else "neither")
    nb, ni = shed["batch"], shed["interactive"]
    return ChoiceCheck(
        "Exercise 4", truth, options={
            "batch": (f"{nb} batch requests got 429: the batch class's waiting room is small, so "
                      "the flood overflows it at once, while interactive requests still find room "
                      "in theirs."),
            "interactive": (f"interactive requests were shed {ni} times here. Each class has its "
                            "own waiting room: which one did the flood fill?"),
            "both": (f"batch: {nb} shed, interactive: {ni} shed. The classes have separate "
                     "waiting rooms: a flood in one does not use up the other's."),
            "neither": f"look at the outcome table: batch {nb} shed, interactive {ni} shed.",
        },
        hint="read the outcome table of the run with per-class budgets (the 'shed' column).",
        solution='answer = "batch"  # flood.counts().loc["batch", "shed"] > 0, interactive: 0',
        namespace=lambda: {"counts": counts})
