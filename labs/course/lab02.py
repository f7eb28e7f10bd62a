"""Lab 02 (continuous batching): static batches' steps and empty seats, the knee of a load sweep,
and where the extra latency goes past it."""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # annotations only: pandas loads with the lab
    import pandas as pd

from minserve.lab.checks import ChoiceCheck, Mistake, NumberCheck, _fmt
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


# ---- static against continuous, repeated -----------------------------------------------------

def alternate(llm, requests, seats: int, repeats: int = 2) -> list[tuple]:
    """``repeats`` more (static, continuous) pairs of runs of ``requests``, the two sides
    alternating, so that a machine that slows down for a while slows both sides alike (one run of
    each is a comparison of two moments, not of two policies)."""
    from minserve.lab.capacity import run_static
    from minserve.lab.workload import run_workload
    pairs = []
    for k in range(repeats):
        s = run_static(llm, requests, seats, live=False, name=f"static, repeat {k + 1}")
        c = run_workload(llm, requests, live=False, name=f"continuous, repeat {k + 1}")
        pairs.append((s, c))
    return pairs


def batching_table(pairs) -> "pd.DataFrame":
    """One row per run of :func:`alternate`'s pairs (and the first pair): its batching, the run
    time, output tokens per second, mean and p90 TTFT, and the CPU other processes took."""
    import pandas as pd
    rows = []
    for k, pair in enumerate(pairs):
        for batching, run in zip(("static", "continuous"), pair):
            ttft = run.requests.ttft_s
            load = run.load.others_cores if run.load is not None else None
            rows.append({"pair": k + 1, "batching": batching, "run time (s)": run.duration_s,
                         "output tok/s": run.summary["output_throughput"],
                         "mean TTFT (ms)": 1000 * ttft.mean(), "p90 TTFT (ms)": 1000 * ttft.quantile(0.9),
                         "others' cores": math.nan if load is None else load})
    return pd.DataFrame(rows)


def sooner_evidence(table) -> tuple[bool, str]:
    """Did continuous batching give requests their first token sooner than static batching?
    Judged on the median over the alternated pairs of each side's mean TTFT; the evidence says
    how many pairs agreed."""
    import numpy as np
    s = table[table.batching == "static"].set_index("pair")["mean TTFT (ms)"]
    c = table[table.batching == "continuous"].set_index("pair")["mean TTFT (ms)"]
    ms, mc = float(np.median(s)), float(np.median(c))
    wins = int((c < s).sum())
    return mc < ms, (f"mean TTFT {mc:.0f} ms with continuous batching against {ms:.0f} ms with static "
                     f"batching (median over {len(s)} alternated pairs of runs; continuous batching "
                     f"was sooner in {wins} of {len(s)} pairs)")


# ---- the knee ---------------------------------------------------------------------------------

KNEE_EFFICIENCY = 0.9  # achieved / offered below this: the engine no longer keeps up
READ_TOL = 0.04        # reading a point's offered load off the x axis (points are >= 20 % apart)
SWEEP_MULTIPLES = (0.85, 1.15, 1.5, 2.0, 2.7)  # run C's loads, in capacities
SWEEP_GAP = 1.2        # no two loads of the sweep closer than this factor


def sweep_rates(rate_b: float, capacity: float) -> list[float]:
    """Run C's offered loads after B's: multiples of the calibrated capacity, from below it to far
    past it, keeping only those at least :data:`SWEEP_GAP` times above the previous load. The
    multiples stay clear of 1.0: a knee point right at the capacity estimate could not be told
    from that estimate (a number read off the y axis) in Exercise 3."""
    rates, last = [], rate_b
    for m in SWEEP_MULTIPLES:
        r = round(m * capacity, 2)
        if r >= SWEEP_GAP * last:
            rates.append(r)
            last = r
    return rates


def knee_rule(table) -> tuple[float, float]:
    """The knee of a load sweep (:func:`~minserve.lab.capacity.load_table`), by the lab's rule:
    the lowest offered load of which the engine achieved less than 90 % (achieved: requests taken
    into a seat per second while requests kept arriving, :func:`~minserve.lab.capacity.achieved_rate`).
    Achieved falls behind offered exactly when the queue builds: below the knee, extra load comes
    out as extra throughput; from there on, part of it stays behind as queue. Returns
    ``(previous load, knee load)``; the previous load is 0 when the lightest load already fell
    short, and the knee NaN when none did."""
    prev = 0.0
    for load in sorted(table.index):
        if float(table.loc[load, "achieved req/s"]) < KNEE_EFFICIENCY * float(load):
            return prev, float(load)
        prev = float(load)
    return prev, math.nan


def suspects(table) -> dict[float, str]:
    """Loads of a sweep whose result its neighbours contradict, with the reason: a load the engine
    fell short of although it kept up with a heavier one, and a load past the knee that achieved
    less than three quarters of the best load past it (every load past the knee keeps the seats
    full, so each should achieve about the same). Both are what a run slowed down by other
    programs looks like."""
    loads = sorted(float(x) for x in table.index)
    ach = {float(x): float(v) for x, v in table["achieved req/s"].items()}
    short = [x for x in loads if ach[x] < KNEE_EFFICIENCY * x]
    out = {}
    for x in short:
        kept = [y for y in loads if y > x and ach[y] >= KNEE_EFFICIENCY * y]
        if kept:
            out[x] = f"the engine kept up with a heavier load, {_fmt(kept[0])} req/s"
    if len(short) >= 2:
        best = max(ach[x] for x in short)
        for x in short:
            if x not in out and ach[x] < 0.75 * best:
                out[x] = f"another load past the knee achieved {best:.2f} req/s"
    return out


def settle_sweep(sweep: dict, run_at, tries: int = 3) -> tuple[dict, list[str]]:
    """Make a load sweep ``{offered: RunResult}`` answer its question on a shared machine, with at
    most ``tries`` more runs (``run_at(load)``), and say what was done:

    - a load whose result its neighbours contradict (:func:`suspects`) is run again, and the
      faster of the two tries is kept: other programs can only slow a run down, never speed it
      up, so the faster try is nearer what the engine does;
    - a heavier load (1.6 x the heaviest) is added while the engine kept up with every load, a
      lighter one (0.6 x the lightest) while it fell short of the lightest: the speed of the
      machine moves between the calibration and the sweep, and the sweep must bracket the knee.

    Returns the sweep sorted by load, and one sentence per run added."""
    from minserve.lab.capacity import achieved_rate, load_table
    sweep, notes, repeated = dict(sweep), [], set()
    for _ in range(tries):
        table = load_table(sweep)
        todo = {x: why for x, why in suspects(table).items() if x not in repeated}
        if todo:
            load = min(todo)
            first, again = float(table.loc[load, "achieved req/s"]), run_at(load)
            second = achieved_rate(again)
            repeated.add(load)
            if second > first:
                sweep[load] = again
            notes.append(f"{_fmt(load)} req/s was run again, because it achieved only {first:.2f} req/s "
                         f"while {todo[load]}; the second try achieved {second:.2f} req/s, and the "
                         "faster of the two is kept")
            continue
        prev, knee = knee_rule(table)
        if math.isnan(knee):
            extra = round(1.6 * max(sweep), 2)
            notes.append(f"{_fmt(extra)} req/s was added: the engine kept up with every load up to "
                         f"{_fmt(max(sweep))} req/s")
        elif prev == 0:
            extra = round(0.6 * min(sweep), 2)
            notes.append(f"{_fmt(extra)} req/s was added: the engine already fell short of the "
                         f"lightest load, {_fmt(min(sweep))} req/s")
        else:
            break
        sweep[extra] = run_at(extra)
    return dict(sorted(sweep.items())), notes


def knee_evidence(table) -> tuple[bool, str]:
    """The lesson of run C, checked on its table: achieved throughput followed the offered load
    below the knee (at least one load below it, every one kept up with) and levelled off past it
    (from the knee to the heaviest load, achieved grew by less than a quarter of what offered
    grew, and the heaviest load was at least 1.5 x the knee)."""
    prev, knee = knee_rule(table)
    if math.isnan(knee):
        return False, (f"the engine kept up with every load up to {_fmt(max(table.index))} req/s: the "
                       "sweep never reached the knee")
    if prev == 0:
        achieved = float(table.loc[knee, "achieved req/s"])
        return False, (f"the engine already fell short at the lightest load, {_fmt(knee)} req/s "
                       f"(achieved {achieved:.2f}): no load below the knee was measured")
    ach = table["achieved req/s"].astype(float)
    top = float(max(table.index))
    at_knee, at_top = float(ach.loc[knee]), float(ach.loc[top])
    below = [float(x) for x in table.index if float(x) < knee]
    worst_below = min(float(ach.loc[x]) / x for x in below)
    offered_growth, achieved_growth = top / knee, at_top / at_knee
    levelled = top >= 1.5 * knee and achieved_growth - 1 < 0.25 * (offered_growth - 1)
    evidence = (f"below the knee ({_fmt(knee)} req/s) the engine achieved at least "
                f"{worst_below:.0%} of each load; from the knee to the heaviest load ({_fmt(top)} req/s) "
                f"offered grew {offered_growth:.1f}x and achieved {achieved_growth:.2f}x "
                f"({at_knee:.2f} to {at_top:.2f} req/s)")
    return levelled, evidence


def busiest(runs):
    """The :class:`~minserve.lab.hygiene.Load` of the run (of ``runs``) during which other
    processes took the most CPU: the measured cause a lesson names when it does not show."""
    loads = [r.load for r in runs if getattr(r, "load", None) is not None]
    known = [x for x in loads if x.others_cores is not None]
    return max(known, key=lambda x: x.others_cores) if known else (loads[0] if loads else None)


def speed_causes(table, capacity: float, limit: float = 0.25) -> list[str]:
    """A measured reason for a knee lesson that did not show: past the knee every load keeps the
    seats full, so each should achieve about the calibrated capacity. Loads that achieved more
    than ``limit`` away from it ran while the machine was faster or slower than when calibrated."""
    prev, knee = knee_rule(table)
    if not math.isfinite(knee) or not capacity > 0:
        return []
    ach = table["achieved req/s"].astype(float)
    past = ach[[float(x) >= knee for x in table.index]]
    off = past[(past / capacity - 1).abs() > limit]
    if off.empty:
        return []
    return [f"past the knee the engine achieved between {past.min():.2f} and {past.max():.2f} req/s "
            f"against a calibrated capacity of {capacity:.2f}: its speed moved during the sweep"]


class KneeCheck(NumberCheck):
    """A NumberCheck of the knee load that says so plainly when the sweep never reached one."""

    def compare(self, answer, expected) -> tuple[bool, str]:
        if expected is None or not math.isfinite(float(expected)):
            return False, ("this run's sweep never reached the knee (the engine achieved at least 90 % "
                           "of every load offered): rerun the sweep with higher rates.")
        return super().compare(answer, expected)


def q3_knee(table, capacity: float | None = None) -> KneeCheck:
    """The knee's offered load, by :func:`knee_rule`, read off the x axis within
    :data:`READ_TOL`. The typical misreadings are named first (the checks' order): the load just
    before the knee, a throughput from the y axis (the achieved value at the knee, the plateau
    past it, the capacity line) and the heaviest load."""
    prev, knee = knee_rule(table)
    loads = sorted(float(x) for x in table.index)
    top = loads[-1]
    ach = table["achieved req/s"].astype(float)
    mistakes = []
    if math.isfinite(knee):
        past = ach[[float(x) >= knee for x in table.index]]
        if prev > 0:
            mistakes.append(Mistake(
                "at that load the engine still kept up (it achieved at least 90 % of it): it is the "
                "last load before the knee. The knee is the first load it fell short of.",
                value=prev, rel_tol=READ_TOL))
        plateau, at_knee = float(past.max()), float(ach.loc[knee])
        mistakes.append(Mistake(
            "that is the height of the plateau (the most the engine achieved past the knee, a "
            "throughput on the y axis); the knee is named by the offered load on the x axis.",
            value=plateau, rel_tol=READ_TOL))
        if abs(at_knee - plateau) > READ_TOL * plateau:
            mistakes.append(Mistake(
                "that is what the engine achieved at the knee, a throughput on the y axis; the "
                "knee is named by its offered load, on the x axis.", value=at_knee, rel_tol=READ_TOL))
        if capacity is not None:
            mistakes.append(Mistake(
                "that is the capacity measured with every request sent at once (the red line): a "
                "throughput, on the y axis. The knee is the offered load, on the x axis, at which "
                "the engine stopped keeping up.", value=float(capacity), rel_tol=READ_TOL))
        if top > knee * (1 + 2 * READ_TOL):
            mistakes.append(Mistake(
                "that is the heaviest load of the sweep, far past the knee: the knee is the *first* "
                "load at which the engine fell short.", value=top, rel_tol=READ_TOL))
    return KneeCheck(
        "Exercise 3", knee, unit="req/s", rel_tol=READ_TOL,
        tolerance_why="reading a point's offered load off the x axis; the loads of the sweep are "
                      "at least 20 % apart, so this names one point",
        hint="on the throughput plot, find the first point below the dashed line (90 % of the "
             "offered load) and answer with its offered load, on the x axis (the table above has "
             "the exact values).",
        solution='short = table["achieved req/s"] < 0.9 * table.index\n'
                 'answer = table.index[short].min()',
        namespace=lambda: {"table": table},
        explanation=(f"The load before it, {_fmt(prev)} req/s, the engine still kept up with: the "
                     "knee lies between the two, and the sweep cannot place it more precisely."
                     if prev > 0 else ""),
        mistakes=mistakes)


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


def queue_evidence(shares) -> tuple[bool, str]:
    """The lesson of Exercise 4, on :func:`latency_shares`: the queue's share of E2E grew the
    most from the lightest load to the heaviest, and requests spent at least a fifth of their
    E2E waiting at the heaviest."""
    grew = shares["share growth"].idxmax()
    q_lo = float(shares.loc["queue", "share at lightest"])
    q_hi = float(shares.loc["queue", "share at heaviest"])
    shown = grew == "queue" and q_hi >= 0.2
    return shown, (f"the queue took {q_lo:.0%} of the mean E2E at the lightest load and {q_hi:.0%} at the "
                   f"heaviest ({1000 * shares.loc['queue', 'lightest (s)']:.0f} to "
                   f"{1000 * shares.loc['queue', 'heaviest (s)']:.0f} ms); the part whose share grew "
                   f"the most: {grew}")
