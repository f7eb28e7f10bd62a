"""Lab 00 (the tour): read the engine's own records, and predict a request's number of steps."""

from __future__ import annotations

from minserve.lab.checks import Mistake, NumberCheck


def _row(reqs, request_id: str):
    rows = reqs[reqs.request_id == request_id]
    if rows.empty:
        raise KeyError(f"request {request_id!r} is not in the frame")
    return rows.iloc[0]


def q1_ttft(reqs, output) -> NumberCheck:
    """TTFT of the streamed request, in ms, read from ``reqs`` (eng.requests_frame()).
    ``output``: that request's final RequestOutput, whose metrics are the measurement."""
    rid = output.request_id
    row = _row(reqs, rid)
    return NumberCheck(
        "Exercise 1", lambda: 1000 * output.metrics.ttft_s, unit="ms",
        abs_tol=1.0, rel_tol=0.02,
        tolerance_why="the table shows milliseconds to 0.01 ms; the engine's records themselves "
                      "agree to the microsecond",
        hint=f"find the row of request {rid!r} in `reqs` and the column that runs from arrival "
             "to the first token; the frame is in seconds.",
        solution=f'answer = 1000 * reqs.loc[reqs.request_id == "{rid}", "ttft_s"].item()',
        namespace=lambda: {"reqs": reqs},
        explanation="TTFT = first token - arrival: the queue wait plus the prefill of the prompt.",
        mistakes=[
            Mistake("that is the end-to-end latency (arrival to finish); TTFT stops at the first "
                    "token.", value=lambda: 1000 * row.e2e_s),
            Mistake("that is the time of the first token counted from the engine's start, not from "
                    "this request's arrival.", value=lambda: 1000 * row.first_token_s, rel_tol=0.005),
            Mistake("that is the TPOT (the gap between later tokens); TTFT is the wait for the first.",
                    value=lambda: 1000 * row.tpot_s),
        ])


def q2_tpot(reqs, output) -> NumberCheck:
    """TPOT of the streamed request, in ms.

    The typical mistakes sit close to the right value: with n tokens, (E2E - TTFT) / n is off by
    a factor (n - 1) / n (2.5 % at n = 40) and E2E / n by the first token's wait spread over n. So
    the tolerance is only what reading the table costs (the notebook shows ms to 0.01 ms),
    and each mistake stays apart from the right answer on a real run (tests/test_lab_exercises_00_01.py
    checks this on the tour's own numbers)."""
    rid = output.request_id
    row = _row(reqs, rid)
    n = len(output.outputs[0].token_ids)
    return NumberCheck(
        "Exercise 2", lambda: 1000 * output.metrics.tpot_s, unit="ms",
        abs_tol=0.05, rel_tol=0.01,
        tolerance_why="an answer read off the table (ms to 0.01 ms) or worked out from its columns "
                      "lands within a few hundredths of a ms; 1 % leaves room for rounding by hand "
                      "and stays below the 1 / n by which the typical mistakes miss. The mean gap "
                      "between tokens (itl_mean_s) also fits: the finish is stamped only "
                      "microseconds after the last token",
        hint="TPOT = (E2E - TTFT) / (output tokens - 1): the average time per token after the first. "
             "`reqs` has it as a column, or compute it from e2e_s, ttft_s and output_tokens.",
        solution=f'answer = 1000 * reqs.loc[reqs.request_id == "{rid}", "tpot_s"].item()',
        namespace=lambda: {"reqs": reqs},
        explanation="After the prompt, each step adds one token per running request: TPOT is the "
                    "decode speed a streaming user sees.",
        mistakes=[
            Mistake(f"that divides the whole E2E by all {n} tokens, so the first token's wait (the "
                    "prefill) is spread over the others; TPOT leaves the first token out.",
                    value=lambda: 1000 * row.e2e_s / n, rel_tol=0.005),
            Mistake(f"that divides by {n} gaps; {n} tokens have {n - 1} gaps between them.",
                    value=lambda: 1000 * (row.e2e_s - row.ttft_s) / n, rel_tol=0.005),
            Mistake(f"that divides the whole E2E by the {n - 1} gaps, but the E2E also holds the wait "
                    "for the first token (the TTFT): take it out first.",
                    value=lambda: 1000 * row.e2e_s / (n - 1), rel_tol=0.005),
            Mistake("that is the TTFT; TPOT is about the tokens after the first.",
                    value=lambda: 1000 * row.ttft_s),
            Mistake("that is a rate, tokens per second (1 / TPOT); the question asks for the time "
                    "per token, in ms.", value=lambda: 1.0 / row.tpot_s),
        ])


def q3_steps(prompt_tokens: int, output_tokens: int, budget: int, measured_steps: int) -> NumberCheck:
    """Steps of one request alone: ceil(P / B) prefill steps (the last samples the first token),
    then N - 1 decode steps."""
    P, N, B = prompt_tokens, output_tokens, budget
    chunks = -(-P // B)
    return NumberCheck(
        "Exercise 3", measured_steps, unit="steps", integer=True,
        tolerance_why="a count of engine steps, the same on every machine",
        hint=f"the prompt is {P} tokens and a step computes at most B = {B} of them. Which step "
             "produces the first output token? Each later token needs one more step.",
        solution="answer = math.ceil(P / B) + N - 1",
        namespace={"P": P, "N": N, "B": B},
        explanation=f"{chunks} prefill chunk{'s' if chunks > 1 else ''} (the last one also samples "
                    f"the first token) + {N - 1} decode steps.",
        mistakes=[
            Mistake("one step too many: the step that computes the last prompt chunk also samples "
                    "the first output token, so only N - 1 decode steps follow.", value=chunks + N),
            Mistake("that counts one step per prompt token; a prefill step computes up to B prompt "
                    "tokens at once (that is what makes prefill fast per token).",
                    test=lambda a: a in (P + N - 1, P + N)),
            Mistake(f"the prompt ({P} tokens) is longer than the step budget B = {B}, so chunked "
                    "prefill splits it over several steps.", test=lambda a: a in (N, N + 1) and chunks > 1),
            Mistake("that counts the prefill steps only; every output token after the first needs "
                    "its own decode step.", value=chunks),
        ])


# ---- the tour's lessons, checked on its own records (lab.lesson prints and records them) ---------

# "About the same time" for one or two decodes: below 1.5x. If each decoded token cost a pass of its
# own, two would take 2x; a step that mostly reads the weights takes nearly 1x.
DECODE_PAIR_LIMIT = 1.5
# "Many times faster per token": at least 3x. A prefill step computes a whole chunk with one pass
# over the weights, a batch-1 decode step one token (8x on the 2-core CPU this was written on).
PREFILL_PER_TOKEN_MIN = 3.0


def decode_steps_by_batch(steps) -> dict[int, "object"]:
    """Step times (s) of the decode-only steps with one and with two decoding requests."""
    dec = steps[steps.num_prefill_tokens == 0]
    return {n: dec.step_time_s[dec.num_decode_tokens == n] for n in (1, 2)}


def decode_pair_lesson(steps) -> tuple[bool, str]:
    """Does a decode step for two requests take about as long as one for a single request?
    (shown, evidence), from the medians of the steps of each kind (at least 5 of each)."""
    by = decode_steps_by_batch(steps)
    n1, n2 = len(by[1]), len(by[2])
    if min(n1, n2) < 5:
        return False, (f"too few decode-only steps to compare ({n1} with one request, {n2} with two; "
                       "5 of each are needed)")
    one, two = float(by[1].median()), float(by[2].median())
    ratio = two / one
    return ratio < DECODE_PAIR_LIMIT, (
        f"median decode step {1000 * one:.1f} ms with one request ({n1} steps), {1000 * two:.1f} ms "
        f"with two ({n2} steps): {ratio:.2f}x the time for twice the tokens (the check: below "
        f"{DECODE_PAIR_LIMIT}x; a pass per token would be 2x)")


def prefill_speed_lesson(prefill_tok_per_s: float, decode_step_s: float) -> tuple[bool, str]:
    """Is prefill many times faster per token than batch-1 decode? (shown, evidence)."""
    decode_tok_per_s = 1.0 / decode_step_s
    ratio = prefill_tok_per_s / decode_tok_per_s
    return ratio >= PREFILL_PER_TOKEN_MIN, (
        f"prefill ran at {prefill_tok_per_s:.0f} prompt tokens/s, batch-1 decode at "
        f"{decode_tok_per_s:.0f} tokens/s (one {1000 * decode_step_s:.1f} ms step per token): "
        f"{ratio:.1f}x per token (the check: at least {PREFILL_PER_TOKEN_MIN:.0f}x)")
