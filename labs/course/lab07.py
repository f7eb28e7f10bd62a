"""Lab 07 (overload and goodput): the service-time calibration every run is sized from, the
measured causes a lesson can name, and the exercises' checks (goodput, the knee, the deadline
model, classes)."""

from __future__ import annotations

import math
import numbers
import statistics

from minserve.lab.checks import Check, ChoiceCheck, Mistake, NumberCheck, _fmt


# ---- the service time: what every rate, window and objective of the lab is scaled from ----------

class ServiceTime:
    """One measurement of the server's service time, for :func:`minserve.lab.calibrate`: two full
    batches of ``requests`` arrive at once; the first wave (the ``seats`` requests that got a
    seat first, by TTFT) runs with every seat busy, and its median start-to-finish time is the
    sample. Each call also keeps the wave's median TPOT and decode time (E2E - TTFT), so the lab
    can size its TPOT objective from the same runs and later compare the sweep's speed with them.

    Why repeat it: a single run scales everything from noise. The first run of a fresh server
    was seen at 1.9 s against 1.1-1.4 s for the next ones; with the rates sized from it, every
    "overload" was in fact light and no lesson appeared."""

    def __init__(self, base_url: str, requests, seats: int):
        self.base_url, self.requests, self.seats = base_url, list(requests), int(seats)
        self.runs: list = []                       # the TrafficResult of every call
        self.tpot_s: list[float] = []
        self.decode_s: list[float] = []

    def __call__(self) -> float:
        from minserve.lab import traffic as tr
        res = tr.offer(self.base_url, tr.calls(self.requests), live=False,
                       name=f"calibration {len(self.runs) + 1}: two full batches at once")
        ok = res.requests[res.requests.outcome == "ok"]
        if len(ok) < self.seats:
            raise RuntimeError(f"the calibration got {len(ok)} answers for {len(res.requests)} requests "
                               f"({res}); the server is not answering normally")
        wave = ok.nsmallest(self.seats, "ttft_s")
        self.runs.append(res)
        self.tpot_s.append(float(wave.tpot_s.median()))
        self.decode_s.append(float((wave.e2e_s - wave.ttft_s).median()))
        return float(wave.e2e_s.median())

    def kept(self, values: list[float], cal) -> float:
        """The median of ``values`` over the runs the calibration ``cal`` kept (its last ones)."""
        return float(statistics.median(values[-len(cal.kept):]))


def speed_drift(calibrated_decode_s: float, frames, *, limit: float = 0.25) -> list[str]:
    """A measured cause for a lesson that did not show: the answered requests of ``frames``
    (request tables of runs with every seat busy) took a different time to decode than in the
    calibration, so the machine's speed changed after the rates and objectives were scaled.
    Empty when the two agree within ``limit`` (or there is nothing to compare)."""
    import pandas as pd
    frames = [f for f in frames if len(f)]
    if not frames or not calibrated_decode_s > 0:
        return []
    ok = pd.concat(frames)
    ok = ok[ok.outcome == "ok"]
    if not len(ok):
        return []
    now = float((ok.e2e_s - ok.ttft_s).median())
    ratio = now / calibrated_decode_s
    if abs(ratio - 1) <= limit:
        return []
    word = "slower" if ratio > 1 else "faster"
    return [f"the machine ran {abs(ratio - 1):.0%} {word} during these runs than during the "
            f"calibration (a request's decode took {1000 * now:.0f} ms against "
            f"{1000 * calibrated_decode_s:.0f} ms), so the load and the objectives sized from the "
            "calibration no longer matched the server"]


def merged(mistakes: list[Mistake], rel_tol: float) -> list[Mistake]:
    """``mistakes`` with those whose values coincide on this run (within ``rel_tol`` of each
    other) merged into one that names them all: a check cannot tell which slip gave such a value,
    and naming only the first would be a wrong diagnosis for the learner who made the other.
    The order is kept (the first of a group leads its message)."""
    out: list[Mistake] = []
    used: set[int] = set()
    for i, m in enumerate(mistakes):
        if i in used:
            continue
        v = m.resolved()
        group = [m]
        if v is not None:
            for j in range(i + 1, len(mistakes)):
                w = mistakes[j].resolved()
                if j not in used and w is not None and math.isclose(v, w, rel_tol=rel_tol):
                    group.append(mistakes[j])
                    used.add(j)
        if len(group) == 1:
            out.append(m)
        else:
            text = "Either " + " Or ".join(g.message for g in group)
            out.append(Mistake(f"{len(group)} slips give that value on this run's numbers. {text}",
                               value=v, rel_tol=max(g.rel_tol for g in group)))
    return out


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
        # The most complete slip first: when the prompt's prefill costs about one decode step
        # (P * p close to d, as on this lab's small requests), "one step short" and "the decode
        # alone" give the same number, and the learner who counted N - 1 steps must hear that.
        mistakes=merged([
            Mistake("one decode step short: the model charges a step for each of the max_tokens "
                    "(it does not give the first token to the prefill).",
                    value=1000 * (P * p + (N - 1) * d), rel_tol=0.003),
            Mistake("that is the prefill alone; the deadline covers the whole answer, so the "
                    "decode steps count too.", value=1000 * P * p, rel_tol=0.01),
            Mistake("that is the decode alone; the prompt has to be prefilled first.",
                    value=1000 * N * d, rel_tol=0.01),
        ], rel_tol=0.01))


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
