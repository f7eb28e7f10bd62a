"""Lab 01 (prefill vs decode): prefill speed, batched decode, the two employees, and the lab's
lessons, each checked on the run's own numbers (the notebook prints them with ``lab.lesson``)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from minserve.lab.checks import ChoiceCheck, Mistake, NumberCheck

PERSONALITIES = ("slow start", "slow generation")


# ---- section 1: TTFT against prompt length -----------------------------------------------------

def ttft_medians(requests) -> pd.DataFrame:
    """Per prompt length: how many runs, and the median TTFT and TPOT of those runs (s). Medians,
    not means: one run slowed by another process moves a mean, not the median of three."""
    g = requests.groupby("prompt_tokens")
    return pd.DataFrame({"runs": g.size(), "ttft_s": g.ttft_s.median(), "tpot_s": g.tpot_s.median()})


def prefill_fit(requests) -> tuple[float, float]:
    """Least-squares line TTFT = a + b * prompt_tokens through the per-length medians; (a, b) in s."""
    med = ttft_medians(requests)
    b, a = np.polyfit(med.index.to_numpy(float), med.ttft_s.to_numpy(float), 1)
    return float(a), float(b)


def fit_r2(requests) -> float:
    """How much of the spread of the median TTFTs the straight line explains (1: all of it)."""
    med = ttft_medians(requests)
    a, b = prefill_fit(requests)
    y = med.ttft_s.to_numpy(float)
    resid = y - (a + b * med.index.to_numpy(float))
    total = float(((y - y.mean()) ** 2).sum())
    return 1.0 - float((resid ** 2).sum()) / total if total > 0 else 0.0


def two_point_rates(requests) -> list[tuple[int, int, float]]:
    """(P1, P2, prefill speed from those two medians) for every pair of lengths at least half the
    range apart: what "take two points far apart" gives on this run (inf: TTFT did not grow)."""
    med = ttft_medians(requests)
    lens = [int(p) for p in med.index]
    span = lens[-1] - lens[0]
    out = []
    for i, p1 in enumerate(lens):
        for p2 in lens[i + 1:]:
            if p2 - p1 >= span / 2:
                dt = float(med.ttft_s[p2] - med.ttft_s[p1])
                out.append((p1, p2, (p2 - p1) / dt if dt > 0 else math.inf))
    return out


# The tolerance of exercise 1 is this run's own: how far the two-point estimates above lie from
# the fitted line's rate, with 20 % on top for reading a plot by eye; at least 5 % (rounding two
# read-off values) and at most 30 % (beyond that the run is too noisy to check a rate against).
RATE_TOL_MIN, RATE_TOL_MAX = 0.05, 0.30


def prefill_rate_tolerance(requests) -> float:
    rate = 1.0 / prefill_fit(requests)[1]
    devs = [abs(r / rate - 1) if math.isfinite(r) else math.inf for _, _, r in two_point_rates(requests)]
    worst = max(devs, default=0.0)
    return float(min(RATE_TOL_MAX, max(RATE_TOL_MIN, round(1.2 * worst, 2))))


def one_point_rates(requests) -> dict[float, tuple[int, float]]:
    """Prompt length / TTFT (tokens/s) of every run and of every per-length median: the answer of
    a learner who divides one prompt by its whole TTFT. {value: (prompt tokens, TTFT s)}."""
    pairs = list(zip(requests.prompt_tokens, requests.ttft_s))
    med = ttft_medians(requests)
    pairs += list(zip(med.index, med.ttft_s))
    return {round(float(p) / float(t), 6): (int(p), float(t)) for p, t in pairs if t > 0}


def q1_prefill_rate(one_at_a_time) -> NumberCheck:
    """Prompt tokens per second of prefill, from the slope of TTFT vs prompt length.

    The typical mistake divides one prompt's length by its TTFT. On a straight line
    TTFT = a + b * P that gives (1 / b) * (1 - a / TTFT): wrong by the share of the TTFT that does
    not grow with the prompt. For the short prompts that share is large (a step reads every weight,
    however few tokens it computes) and the mistake is named. For a long prompt it can be smaller
    than this run's noise; that answer is then right within the tolerance and is accepted, with a
    note saying why (a mistake the run cannot tell from the right answer tests nothing)."""
    reqs = one_at_a_time.requests
    a, b = prefill_fit(reqs)
    rate = 1.0 / b
    tol = prefill_rate_tolerance(reqs)
    pairs = two_point_rates(reqs)
    finite = [r for _, _, r in pairs if math.isfinite(r)]
    spread = (f"from {min(finite):.0f} to {max(finite):.0f} tokens/s" if finite else "undefined")
    mistakes = [
        Mistake("that is the slope itself in milliseconds per token; the question asks for its "
                "inverse, tokens per second.", value=1000 * b, rel_tol=0.05),
        Mistake("that is the slope itself, seconds per token; the prefill speed is its inverse.",
                value=b, rel_tol=0.05),
    ]
    close = []
    for v, (p, t) in sorted(one_point_rates(reqs).items()):
        if abs(v - rate) > tol * rate:
            mistakes.append(Mistake(
                f"that divides one prompt's length by its whole TTFT ({p} tokens / {1000 * t:.0f} ms). "
                "A TTFT also holds a part that does not grow with the prompt (a step reads all the "
                "weights, however few tokens it computes); the slope between two lengths far apart "
                "leaves it out.", value=v, rel_tol=0.02))
        else:
            close.append(p)
    note = ""
    if close:
        note = (f" (One prompt's length / its TTFT gives nearly the same here for {max(close)} tokens: "
                "next to a long prefill, the part of the TTFT that does not grow with the prompt is "
                "small. On the shortest prompt it is not.)")
    return NumberCheck(
        "Exercise 1", rate, unit="tokens/s", rel_tol=tol,
        tolerance_why=f"two-point estimates from the medians of lengths far apart give {spread} in "
                      "this run, within this range of the fitted line's rate (plus a margin for "
                      "reading the plot)",
        hint="TTFT grows by (slope) seconds per extra prompt token; the prefill speed is the "
             "inverse of that slope. Take the medians of two lengths far apart (the table `med`): "
             "(P2 - P1) / (TTFT2 - TTFT1).",
        solution="med = reqs.groupby(\"prompt_tokens\").ttft_s.median()\n"
                 "slope, intercept = np.polyfit(med.index, med.values, 1)\n"
                 "answer = 1 / slope",
        namespace=lambda: {"reqs": reqs, "np": np},
        explanation="Prefill computes all prompt tokens of a chunk in one forward pass; its cost "
                    "grows with the number of tokens, which is why TTFT tracks prompt length." + note,
        mistakes=mistakes)


def ttft_lesson(requests) -> tuple[bool, str]:
    """Lesson 01-ttft-grows: every longer prompt's median TTFT is above the shorter ones', and a
    straight line explains at least 95 % of their spread (R^2 >= 0.95). (shown, evidence)."""
    med = ttft_medians(requests)
    rising = bool(np.all(np.diff(med.ttft_s.to_numpy(float)) > 0))
    r2 = fit_r2(requests)
    lo, hi = med.iloc[0], med.iloc[-1]
    p_lo, p_hi = int(med.index[0]), int(med.index[-1])
    order = ("each longer prompt's median above the one before" if rising
             else "the medians do not rise with every longer prompt")
    return rising and r2 >= 0.95, (
        f"median TTFT {1000 * lo.ttft_s:.0f} ms at {p_lo} tokens, {1000 * hi.ttft_s:.0f} ms at "
        f"{p_hi} tokens ({hi.ttft_s / lo.ttft_s:.1f}x for {p_hi / p_lo:.0f}x the tokens), {order}; "
        f"a straight line explains {100 * r2:.1f} % of their spread (the check: every step up, and "
        f"at least 95 %); TPOT meanwhile {1000 * lo.tpot_s:.1f} -> {1000 * hi.tpot_s:.1f} ms "
        f"({hi.tpot_s / lo.tpot_s:.2f}x)")


def describe_fit(requests, load=None) -> str:
    """What the fitted line says, in words chosen from its numbers: the intercept is called a
    fixed cost only when it is one (a negative intercept is no cost, and ``load``, the runs'
    :class:`~minserve.lab.hygiene.Load`, says whether other processes may have bent the line),
    and the shortest prompt is compared with what its tokens cost at the slope."""
    a, b = prefill_fit(requests)
    med = ttft_medians(requests)
    p0, t0 = int(med.index[0]), float(med.ttft_s.iloc[0])
    text = (f"The line: TTFT = {1000 * a:.0f} ms + {1000 * b:.2f} ms x prompt tokens, a prefill "
            f"speed of {1 / b:.0f} tokens/s. ")
    if a >= 0:
        text += (f"Its intercept, {1000 * a:.0f} ms, is the part of a TTFT that does not grow with "
                 "the prompt. ")
    else:
        if load is not None and load.busy:
            why = f"or other processes slowed the long runs: {load.describe()}"
        elif load is not None and load.others_cores is not None:
            why = "the machine was quiet, so not other processes"
        else:
            why = "or other processes slowed the long runs"
        text += (f"It crosses the TTFT axis below zero ({1000 * a:.0f} ms), and no cost is negative: "
                 "per token, the longer prompts cost more than the shorter ones in this run (a later "
                 f"prompt chunk also attends to every token before it; {why}), so a straight line "
                 "fits only roughly. Read its slope, not its intercept (the baseline records the "
                 "fixed part as 0). ")
    at_slope = b * p0
    if at_slope > 0 and t0 >= 1.5 * at_slope:
        text += (f"The shortest prompt ({p0} tokens) took {1000 * t0:.0f} ms, {t0 / at_slope:.1f}x "
                 f"what its tokens cost at the slope ({1000 * at_slope:.0f} ms): a step reads every "
                 "weight once, however few tokens it computes.")
    else:
        text += (f"The shortest prompt ({p0} tokens) took {1000 * t0:.0f} ms, close to what its "
                 f"tokens cost at the slope ({1000 * at_slope:.0f} ms).")
    return text


# ---- section 2: TPOT against the running batch ---------------------------------------------------

def decode_rate_from_steps(run) -> float:
    """Output tokens per second over the run's decode-only steps (the engine's own step records);
    NaN over HTTP, where no step records exist."""
    if run.steps is None:
        return float("nan")
    st = run.steps
    dec = st[(st.num_prefill_tokens == 0) & (st.num_decode_tokens > 0)]
    # Tokens produced: one per decoding request, plus the proposals the model accepted.
    produced = dec.num_decode_tokens - dec.num_spec_tokens + dec.num_accepted_spec_tokens
    return float(produced.sum() / dec.step_time_s.sum())


# "Far slower than the batch": from the smallest to the largest batch, TPOT grows by at most half
# the batch's factor, so the engine's tokens/s at least doubles. If a step cost the same per
# request, TPOT would grow by the batch's own factor and batching would buy nothing; a step that
# only read the weights would keep TPOT flat. (On the 2-core CPU this was written on: x2.9 for
# x16 the requests.)
TPOT_GROWTH_SHARE = 0.5


def tpot_lesson(tpot_s: dict) -> tuple[bool, str]:
    """Lesson 01-tpot-batch from ``{batch: TPOT in s}`` (calibrated medians). (shown, evidence)."""
    b1, bn = min(tpot_s), max(tpot_s)
    growth, batch_x = tpot_s[bn] / tpot_s[b1], bn / b1
    return growth <= TPOT_GROWTH_SHARE * batch_x, (
        f"TPOT {1000 * tpot_s[b1]:.1f} ms at batch {b1}, {1000 * tpot_s[bn]:.1f} ms at batch {bn}: "
        f"x{growth:.1f} for x{batch_x:.0f} the requests, so {batch_x / growth:.1f}x the tokens/s "
        f"(the check: TPOT grows by at most {TPOT_GROWTH_SHARE:.0%} of the batch's factor)")


def q2_decode_throughput(batch_runs: dict) -> NumberCheck:
    """Aggregate decode tokens/s at the largest batch, from its TPOT (checked against the steps)."""
    b = max(batch_runs)
    run = batch_runs[b]
    tpot = float(run.requests.tpot_s.mean())
    return NumberCheck(
        "Exercise 2", lambda: decode_rate_from_steps(run), unit="tokens/s", rel_tol=0.2,
        tolerance_why="TPOT also counts the time between steps (the scheduler, Python, the load "
                      "generator), the step records only the forward passes; on a shared CPU the "
                      "two differ by up to ~20 %",
        hint=f"{b} requests decode together: each step gives each of them one token, and a token "
             "of one request arrives every TPOT seconds.",
        solution=f"tpot = batch_runs[{b}].requests.tpot_s.mean()\nanswer = {b} / tpot",
        namespace=lambda: {"batch_runs": batch_runs},
        explanation="One decode step reads all the weights once whatever the batch, so a bigger "
                    "batch turns the same weight traffic into more tokens.",
        mistakes=[
            Mistake(f"that is one stream's rate (1 / TPOT); {b} streams decode at the same time.",
                    value=lambda: 1.0 / tpot, rel_tol=0.05),
            Mistake("that is the rate at batch 1; the question asks about the largest batch.",
                    value=lambda: 1.0 / float(batch_runs[min(batch_runs)].requests.tpot_s.mean()),
                    rel_tol=0.05),
        ])


# ---- section 3: the two employees ----------------------------------------------------------------

def long_prompt_tokens(budget: int) -> int:
    """A's prompt: two and a half step budgets. A's chunks fill two steps and half of a third, so
    B (a few tokens) is admitted in the third step: the right count of queued steps is 2, and
    rounding up P_A / budget gives 3 (a whole number of budgets would make both right)."""
    return budget * 5 // 2


def growth(alone_row, mixed_row) -> tuple[float, float]:
    """(TTFT ratio, TPOT ratio) of B from alone to mixed."""
    return mixed_row.ttft_s / alone_row.ttft_s, mixed_row.tpot_s / alone_row.tpot_s


def personality(alone_row, mixed_row) -> str:
    """Which of B's numbers grew more (as a ratio) from alone to mixed: TTFT or TPOT."""
    ttft_ratio, tpot_ratio = growth(alone_row, mixed_row)
    return "slow start" if ttft_ratio > tpot_ratio else "slow generation"


_SOLUTION = ('t, p = {mixed}.ttft_s / b_alone.ttft_s, {mixed}.tpot_s / b_alone.tpot_s  # how much each grew\n'
             'answer = "slow start" if t > p else "slow generation"')


def _options(alone_row, mixed_row, start_why: str, generation_why: str) -> dict[str, str]:
    t, p = growth(alone_row, mixed_row)
    return {
        "slow start": f"A slow start is a TTFT that grew: here B's TTFT was {t:.1f}x what it was "
                      f"alone, its TPOT {p:.1f}x. {start_why}",
        "slow generation": f"A slow generation is a TPOT that grew: here B's TPOT was {p:.1f}x what "
                           f"it was alone, its TTFT {t:.1f}x. {generation_why}",
    }


def q3_a_then_b(b_alone, b_behind_a) -> ChoiceCheck:
    """A (long RAG prompt) arrives first, B (short question) right behind: what hurt B?"""
    return ChoiceCheck(
        "Exercise 3", lambda: personality(b_alone, b_behind_a),
        options=_options(b_alone, b_behind_a,
                         "B's prompt is tiny, but it arrived behind A: the scheduler gives each "
                         "step's budget to A's prompt chunks first, so B waits in the queue for them.",
                         "Once B has its first token, A is decoding too, and the two decodes share "
                         "each step."),
        hint="compare B's TTFT and TPOT in the A-then-B run with B alone: which grew by the larger "
             "factor?",
        solution=_SOLUTION.format(mixed="b_behind_a"),
        namespace=lambda: {"b_alone": b_alone, "b_behind_a": b_behind_a})


def q4_b_then_a(b_alone, b_before_a) -> ChoiceCheck:
    """B starts first, A's long prompt arrives while B decodes: what hurt B?"""
    return ChoiceCheck(
        "Exercise 4", lambda: personality(b_alone, b_before_a),
        options=_options(b_alone, b_before_a,
                         "B arrived first, before A was sent, so nothing stood in front of its "
                         "prompt.",
                         "When a long prompt arrives during a short request's decode, decodes are "
                         "still scheduled first, but a step that also carries a prompt chunk takes "
                         "about as long as that chunk."),
        hint="compare B's TTFT and TPOT in the B-then-A run with B alone; then look at the gaps "
             "between B's tokens in the plot above.",
        solution=_SOLUTION.format(mixed="b_before_a"),
        namespace=lambda: {"b_alone": b_alone, "b_before_a": b_before_a})


# A slow start: B's TTFT at least doubled, and grew more than its TPOT. A slow generation: B's TPOT
# grew by at least half (run to run, a 32-token request's TPOT moves by about a tenth on a quiet
# machine), and more than its TTFT.
SLOW_START_X, SLOW_GENERATION_X = 2.0, 1.5


def slow_start_lesson(b_alone, b_behind_a) -> tuple[bool, str]:
    t, p = growth(b_alone, b_behind_a)
    return t >= SLOW_START_X and t > p, (
        f"B's TTFT {1000 * b_alone.ttft_s:.0f} ms alone, {1000 * b_behind_a.ttft_s:.0f} ms behind A "
        f"({t:.1f}x), its TPOT {p:.2f}x (the check: TTFT at least {SLOW_START_X:.0f}x, and grown "
        "more than TPOT)")


def slow_generation_lesson(b_alone, b_before_a) -> tuple[bool, str]:
    t, p = growth(b_alone, b_before_a)
    return p >= SLOW_GENERATION_X and p > t, (
        f"B's TPOT {1000 * b_alone.tpot_s:.1f} ms alone, {1000 * b_before_a.tpot_s:.1f} ms when A "
        f"arrived during its decode ({p:.1f}x), its TTFT {t:.2f}x; B's longest gap between tokens "
        f"{1000 * b_before_a.itl_max_s:.0f} ms (alone {1000 * b_alone.itl_max_s:.0f} ms) (the check: "
        f"TPOT at least {SLOW_GENERATION_X}x, and grown more than TTFT)")


def q5_steps_queued(prompt_a: int, budget: int, measured_steps: int) -> NumberCheck:
    """Steps B spent queued behind A's prefill (both arrive together, A first)."""
    full = prompt_a // budget
    rounded_up = -(-prompt_a // budget)
    mistakes = []
    if rounded_up != full:
        mistakes.append(Mistake(
            f"that rounds up ({prompt_a} / {budget} = {prompt_a / budget:.2f}): the step in which A's "
            "last chunk leaves budget over admits B in that same step (chunked prefill lets any "
            "leftover budget be used).", value=rounded_up))
    else:
        mistakes.append(Mistake("one too many: B is admitted *in* the step after A's full chunks, "
                                "so it queued during those steps only.", value=full + 1))
    if full > 0:
        mistakes.append(Mistake("B did queue: both arrived together and A came first.", value=0))
    return NumberCheck(
        "Exercise 5", measured_steps, unit="steps", integer=True,
        tolerance_why="a count of engine steps, the same on every machine",
        hint=f"each step has a budget of {budget} tokens, and A's prompt ({prompt_a} tokens) "
             "comes first. B can join the first step that has any budget left over (with chunked "
             "prefill, even a part of its prompt may start).",
        solution="answer = P_A // B  # steps whose whole budget A's chunks take",
        namespace={"P_A": prompt_a, "B": budget},
        explanation=f"A's prompt fills {full} step(s) completely; B is admitted in the next one.",
        mistakes=mistakes)


# ---- section 4: distributions --------------------------------------------------------------------

def tail_lesson(pct) -> tuple[bool, str]:
    """Lesson 01-tail from ``compare_distributions``' table (ms, rows "short only" and
    "short + RAG"): the short questions' p90 TTFT rose, and by more than their median did."""
    lo, hi = pct.loc["short only"], pct.loc["short + RAG"]
    d50, d90 = hi["p50"] - lo["p50"], hi["p90"] - lo["p90"]
    return d90 > 0 and d90 > d50, (
        f"short questions' TTFT median {lo['p50']:.0f} -> {hi['p50']:.0f} ms ({d50:+.0f} ms), p90 "
        f"{lo['p90']:.0f} -> {hi['p90']:.0f} ms ({d90:+.0f} ms), mean {lo['mean']:.0f} -> "
        f"{hi['mean']:.0f} ms (the check: p90 rose, and by more than the median)")
