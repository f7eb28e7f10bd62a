"""Lab 01 (prefill vs decode): prefill speed, batched decode, and the two employees."""

from __future__ import annotations

import numpy as np

from minserve.lab.checks import ChoiceCheck, Mistake, NumberCheck

PERSONALITIES = ("slow start", "slow generation")


def prefill_fit(requests) -> tuple[float, float]:
    """Least-squares line TTFT = a + b * prompt_tokens over ``requests`` (a frame); (a, b) in s."""
    b, a = np.polyfit(requests.prompt_tokens.to_numpy(float), requests.ttft_s.to_numpy(float), 1)
    return float(a), float(b)


def q1_prefill_rate(one_at_a_time) -> NumberCheck:
    """Prompt tokens per second of prefill, from the slope of TTFT vs prompt length."""
    reqs = one_at_a_time.requests
    return NumberCheck(
        "Exercise 1", lambda: 1.0 / prefill_fit(reqs)[1], unit="tokens/s", rel_tol=0.3,
        tolerance_why="a slope read off the plot, or taken from two points, differs from the "
                      "least-squares fit over all points by this run's noise",
        hint="TTFT grows by (slope) seconds per extra prompt token; the prefill speed is the "
             "inverse of that slope. Take two points far apart: (TTFT2 - TTFT1) / (P2 - P1).",
        solution="slope, intercept = np.polyfit(reqs.prompt_tokens, reqs.ttft_s, 1)\n"
                 "answer = 1 / slope",
        namespace=lambda: {"reqs": reqs, "np": np},
        explanation="Prefill computes all prompt tokens of a chunk in one forward pass; its cost "
                    "grows with the number of tokens, which is why TTFT tracks prompt length.",
        mistakes=[
            Mistake("that is the slope itself in milliseconds per token; the question asks for its "
                    "inverse, tokens per second.", value=lambda: 1000 * prefill_fit(reqs)[1], rel_tol=0.3),
            Mistake("that divides one prompt's length by its whole TTFT, which includes the fixed "
                    "cost of a step (and the first token); the slope leaves the fixed part out.",
                    test=lambda a: any(abs(a - p / t) <= 0.02 * p / t
                                       for p, t in zip(reqs.prompt_tokens, reqs.ttft_s))
                    and abs(a * prefill_fit(reqs)[1] - 1) > 0.3),
        ])


def decode_rate_from_steps(run) -> float:
    """Output tokens per second over the run's decode-only steps (the engine's own step records)."""
    st = run.steps
    dec = st[(st.num_prefill_tokens == 0) & (st.num_decode_tokens > 0)]
    # Tokens produced: one per decoding request, plus the proposals the model accepted.
    produced = dec.num_decode_tokens - dec.num_spec_tokens + dec.num_accepted_spec_tokens
    return float(produced.sum() / dec.step_time_s.sum())


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


def personality(alone_row, mixed_row) -> str:
    """Which of B's numbers grew more (as a ratio) from alone to mixed: TTFT or TPOT."""
    ttft_ratio = mixed_row.ttft_s / alone_row.ttft_s
    tpot_ratio = mixed_row.tpot_s / alone_row.tpot_s
    return "slow start" if ttft_ratio > tpot_ratio else "slow generation"


_OPTIONS_AB = {
    "slow start": "B's prompt is tiny, but it arrived behind A: the scheduler gave each step's "
                  "whole budget to A's prompt chunks, so B waited in the queue for A's prefill "
                  "before its own could start.",
    "slow generation": "look at B's TPOT in the A-then-B run: once B has its first token, A is "
                       "already decoding too, and two decodes share a step at almost no cost.",
}
_OPTIONS_BA = {
    "slow start": "B arrived first and got its first token before A came in, so its TTFT is what "
                  "it was alone. Look at the gaps between its later tokens instead.",
    "slow generation": "B was already decoding when A arrived; decodes are scheduled first, but "
                       "the steps B shared with A's prompt chunks each took as long as a chunk "
                       "prefill, so B's tokens came out in bursts with long gaps.",
}


def q3_a_then_b(b_alone, b_behind_a) -> ChoiceCheck:
    """A (long RAG prompt) arrives first, B (short question) right behind: what hurt B?"""
    return ChoiceCheck(
        "Exercise 3", lambda: personality(b_alone, b_behind_a), options=_OPTIONS_AB,
        hint="compare B's TTFT and TPOT in the A-then-B run with B alone: which grew by the larger "
             "factor?",
        solution='answer = "slow start"  # B\'s TTFT grew far more than its TPOT:\n'
                 "# b_behind_a.ttft_s / b_alone.ttft_s  >>  b_behind_a.tpot_s / b_alone.tpot_s",
        namespace=lambda: {"b_alone": b_alone, "b_behind_a": b_behind_a})


def q4_b_then_a(b_alone, b_before_a) -> ChoiceCheck:
    """B starts first, A's long prompt arrives while B decodes: what hurt B?"""
    return ChoiceCheck(
        "Exercise 4", lambda: personality(b_alone, b_before_a), options=_OPTIONS_BA,
        hint="compare B's TTFT and TPOT in the B-then-A run with B alone; then look at the gaps "
             "between B's tokens in the plot above.",
        solution='answer = "slow generation"  # B\'s TPOT grew, its TTFT did not:\n'
                 "# b_before_a.tpot_s / b_alone.tpot_s  >>  b_before_a.ttft_s / b_alone.ttft_s",
        namespace=lambda: {"b_alone": b_alone, "b_before_a": b_before_a})


def q5_steps_queued(prompt_a: int, budget: int, measured_steps: int) -> NumberCheck:
    """Steps B spent queued behind A's prefill (both arrive together, A first)."""
    full = prompt_a // budget
    return NumberCheck(
        "Exercise 5", measured_steps, unit="steps", integer=True,
        tolerance_why="a count of engine steps, the same on every machine",
        hint=f"each step has a budget of {budget} tokens, and A's prompt ({prompt_a} tokens) "
             "comes first. B can join the first step that has any budget left over (with chunked "
             "prefill, even a part of its prompt may start).",
        solution="answer = P_A // B  # steps whose whole budget A's chunks take",
        namespace={"P_A": prompt_a, "B": budget},
        explanation=f"A's prompt fills {full} step(s) completely; B is admitted in the next one.",
        mistakes=[
            Mistake("that rounds up: a step in which A's last chunk leaves budget over admits B in "
                    "that same step (chunked prefill lets any leftover budget be used).",
                    test=lambda a: a == -(-prompt_a // budget) and prompt_a % budget != 0),
            Mistake("one too many: B is admitted *in* the step after A's full chunks, so it queued "
                    "during those steps only.", value=full + 1),
            Mistake("B did queue: both arrived together and A came first.", value=0),
        ])
