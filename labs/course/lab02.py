"""Lab 02 (continuous batching): static batches' steps and empty seats, the knee of a load sweep,
and where the extra latency goes past it."""

from __future__ import annotations

import math
import numbers

from minserve.lab.checks import Check, ChoiceCheck, Mistake, NumberCheck, _fmt
from minserve.lab.capacity import seat_use

COMPONENTS = ("queue", "prefill", "decode")


def static_steps(outputs, batch_size: int) -> int:
    """Steps of static batching when each batch's prompts fit in one step: every batch runs until
    its longest answer is done, one step per output token (the prefill step samples the first)."""
    outputs = list(outputs)
    return int(sum(max(outputs[i:i + batch_size]) for i in range(0, len(outputs), batch_size)))


def q1_static_steps(outputs, batch_size: int, measured_steps: int) -> NumberCheck:
    """How many engine steps the static run took (counted in its step records)."""
    outs, S = list(outputs), int(batch_size)
    n_batches = -(-len(outs) // S)
    return NumberCheck(
        "Exercise 1", int(measured_steps), unit="steps", integer=True,
        tolerance_why="a count of engine steps, the same on every machine",
        hint=f"the requests go in batches of {S}, in order. A batch keeps the engine until its "
             "longest answer is done, and an answer of n tokens needs n steps (the prefill step "
             "already samples the first token).",
        solution=f"answer = sum(max(outs[i:i + {S}]) for i in range(0, len(outs), {S}))",
        namespace=lambda: {"outs": outs},
        explanation="Only the longest answer of each batch counts; the shorter ones finish early "
                    "and leave their seats empty until the batch ends.",
        mistakes=[
            Mistake("that is the total number of output tokens, as if one request ran at a time; "
                    f"a batch computes up to {S} requests in each step.", value=sum(outs)),
            Mistake(f"that is the total output divided by {S}: what it would take if every seat "
                    "were busy in every step. A static batch cannot refill a seat whose request "
                    "has finished, so count each batch's longest answer instead.",
                    test=lambda a: isinstance(a, numbers.Number)
                    and abs(a - sum(outs) / S) <= 1 and a != static_steps(outs, S)),
            Mistake("one step too many per batch: the step that prefills a batch also samples every "
                    "member's first token, so an answer of n tokens needs n steps, not n + 1.",
                    value=static_steps(outs, S) + n_batches),
            Mistake(f"that takes the longest answer of the whole workload for every one of the "
                    f"{n_batches} batches; each batch waits only for its own longest answer.",
                    test=lambda a: a == n_batches * max(outs) and a != static_steps(outs, S)),
        ])


def q2_empty_seats(static_run, continuous_run, seats: int, outputs) -> NumberCheck:
    """The share of seat-steps the static run left empty (seats x steps, minus the requests
    computed in each step)."""
    outs = list(outputs)
    use = seat_use(static_run, seats)
    cont = seat_use(continuous_run, seats)
    return NumberCheck(
        "Exercise 2", lambda: use["empty_share"], unit="", abs_tol=0.01,
        tolerance_why="a fraction from whole counts; two decimals are enough",
        hint=f"the static run had {seats} seats in each of its steps. Each request sat in one seat "
             "for as many steps as it has output tokens; the rest of the seat-steps were empty.",
        solution=f"answer = 1 - sum(outs) / ({seats} * static_steps)",
        namespace=lambda: {"outs": outs, "static_steps": use["steps"]},
        explanation=f"The continuous run left only {cont['empty_share']:.0%} empty: a finished "
                    "request's seat goes to a waiting one in the very next step.",
        mistakes=[
            Mistake("that is the share of seat-steps that were *busy*; the question asks for the "
                    "empty share (1 minus this).",
                    test=lambda a: isinstance(a, numbers.Number)
                    and abs(a - (1 - use["empty_share"])) <= 0.01
                    and abs(a - use["empty_share"]) > 0.01),
            Mistake("that is the continuous run's empty share; the question is about the static run.",
                    test=lambda a: isinstance(a, numbers.Number)
                    and abs(a - cont["empty_share"]) <= 0.01 and abs(a - use["empty_share"]) > 0.01),
            Mistake("give a fraction between 0 and 1, not a percentage.",
                    test=lambda a: isinstance(a, numbers.Number) and 1 < a <= 100
                    and abs(a / 100 - use["empty_share"]) <= 0.01),
        ])


# ---- the knee ---------------------------------------------------------------------------------

KNEE_EFFICIENCY = 0.9  # achieved / offered below this: the engine no longer keeps up


def knee_rule(table) -> tuple[float, float]:
    """The knee of a load sweep (:func:`~minserve.lab.capacity.load_table`), by the lab's rule:
    the lowest offered load of which the engine achieved less than 90 % (achieved requests per
    second over the run, against offered). Below it, extra load comes out as extra throughput;
    from there on, part of it stays behind as queue. Returns ``(previous load, knee load)``; the
    previous load is 0 when the lightest load already fell short, and the knee NaN when none did."""
    prev = 0.0
    for load in sorted(table.index):
        if float(table.loc[load, "achieved req/s"]) < KNEE_EFFICIENCY * float(load):
            return prev, float(load)
        prev = float(load)
    return prev, math.nan


class KneeCheck(Check):
    """The learner's knee (an offered load) against :func:`knee_rule`: the rule first holds at the
    knee point and did not at the point before, so any value above the point before and up to the
    knee point is consistent with this run's data, plus ``slack`` (relative) above the knee point
    for reading a value off the axis."""

    def __init__(self, name: str, table, *, slack: float = 0.05, unit: str = "req/s",
                 mistakes: list[Mistake] | None = None, **kw):
        super().__init__(name, lambda: knee_rule(table), **kw)
        self.slack, self.unit, self.mistakes = slack, unit, list(mistakes or [])

    def compare(self, answer, expected) -> tuple[bool, str]:
        prev, knee = expected
        if math.isnan(knee):
            return False, ("this run's sweep never reached the knee (the engine achieved at least 90 % "
                           "of every load offered): rerun the sweep with higher rates.")
        if isinstance(answer, bool) or not isinstance(answer, numbers.Number) or not math.isfinite(float(answer)):
            return False, f"the answer should be an offered load in {self.unit}, got {answer!r}."
        a = float(answer)
        lo, hi = prev, knee * (1 + self.slack)
        why = (f"the engine first fell short at {_fmt(knee)} {self.unit} and kept up at {_fmt(prev)} "
               f"{self.unit}, so the knee lies between them; the sweep cannot place it more "
               f"precisely, and {self.slack:.0%} above the knee point is allowed for reading the axis")
        if lo < a <= hi:
            return True, f"{_fmt(a)} {self.unit} is at the knee ({why})."
        for m in self.mistakes:
            if m.matches(answer):
                return False, f"{_fmt(a)} {self.unit} is not it: {m.message}"
        side = "above" if a > hi else "below"
        return False, (f"{_fmt(a)} {self.unit} is {side} this run's knee ({why}). "
                       f"Hint: {self.hint_text}")


def q3_knee(table) -> KneeCheck:
    loads = sorted(table.index)
    top = float(loads[-1])
    best = float(table["achieved req/s"].max())
    prev, knee = knee_rule(table)
    return KneeCheck(
        "Exercise 3", table,
        hint="on the throughput plot, find the first point below the dashed line (90 % of the "
             "offered load) and answer with its offered load, on the x axis.",
        solution='short = table["achieved req/s"] < 0.9 * table.index\n'
                 'answer = table.index[short].min()',
        namespace=lambda: {"table": table},
        mistakes=[  # the point before the knee first: it can also be close to the plateau
            Mistake("at that load the engine still achieved 90 % of what was offered or more: it is "
                    "the last load it kept up with, just before the knee.",
                    test=lambda a: prev > 0 and abs(a - prev) <= 0.05 * prev),
            Mistake("that is the most the engine achieved (the plateau on the y axis of the "
                    "throughput plot); the knee is named by the offered load on the x axis.",
                    test=lambda a: abs(a - best) <= 0.05 * best and not (prev < a <= knee * 1.05)),
            Mistake("that is the heaviest load of the sweep, far past the knee: the knee is the "
                    "*first* load at which queueing takes over.",
                    test=lambda a: abs(a - top) <= 0.05 * top and top > knee * 1.05),
        ])


# ---- past the knee ----------------------------------------------------------------------------

PARTS = {"queue": "queue_s", "prefill": "prefill_s", "decode": "decode_s"}


def latency_shares(light_requests, heavy_requests):
    """Per part of a request's life (queue, prefill, decode): its mean in seconds and its share of
    the mean E2E, at the lightest and the heaviest load, and how much the share grew. Shares do
    not move when the whole machine slows down for a while, which the seconds do."""
    import pandas as pd
    rows = {}
    for part, col in PARTS.items():
        lo, hi = float(light_requests[col].mean()), float(heavy_requests[col].mean())
        lo_e2e, hi_e2e = float(light_requests.e2e_s.mean()), float(heavy_requests.e2e_s.mean())
        rows[part] = {"lightest (s)": lo, "heaviest (s)": hi, "share at lightest": lo / lo_e2e,
                      "share at heaviest": hi / hi_e2e, "share growth": hi / hi_e2e - lo / lo_e2e}
    return pd.DataFrame(rows).T


def q4_where_it_goes(light_requests, heavy_requests, seats: int) -> ChoiceCheck:
    """Which part of a request's life took a larger share of its E2E at the heaviest load."""
    def expected():
        return latency_shares(light_requests, heavy_requests)["share growth"].idxmax()
    return ChoiceCheck(
        "Exercise 4", expected,
        options={
            "queue": "queue time is the wait for a free seat. Past the knee all "
                     f"{seats} seats are taken, so each extra request waits behind every request "
                     "ahead of it: more offered load only makes the line longer.",
            "prefill": "prefill time depends on the prompt, the same at every load, and on the "
                       "decodes sharing its step, at most one per other seat. Compare its share "
                       "with the queue's.",
            "decode": "decode time depends on how many requests share each step, and the batch "
                      f"cannot grow past the {seats} seats however much load waits outside. "
                      "Compare its share with the queue's.",
        },
        hint="in the table above, which part's share of the E2E latency grew from the lightest "
             "load to the heaviest?",
        solution='parts = ["queue_s", "prefill_s", "decode_s"]\n'
                 'share = lambda r: r[parts].mean() / r.e2e_s.mean()\n'
                 'growth = share(heavy) - share(light)\n'
                 'answer = growth.idxmax().removesuffix("_s")',
        namespace=lambda: {"light": light_requests, "heavy": heavy_requests})
