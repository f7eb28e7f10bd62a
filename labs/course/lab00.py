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
        tolerance_why="the table shows seconds rounded to the millisecond; the engine's records "
                      "themselves agree to the microsecond",
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
    """TPOT of the streamed request, in ms."""
    rid = output.request_id
    row = _row(reqs, rid)
    n = len(output.outputs[0].token_ids)
    return NumberCheck(
        "Exercise 2", lambda: 1000 * output.metrics.tpot_s, unit="ms",
        abs_tol=0.5, rel_tol=0.03,
        tolerance_why="the table rounds; the mean gap between tokens (itl_mean_s) is also accepted, "
                      "since the finish is stamped only microseconds after the last token",
        hint="TPOT = (E2E - TTFT) / (output tokens - 1): the average time per token after the first. "
             "`reqs` has it as a column, or compute it from e2e_s, ttft_s and output_tokens.",
        solution=f'answer = 1000 * reqs.loc[reqs.request_id == "{rid}", "tpot_s"].item()',
        namespace=lambda: {"reqs": reqs},
        explanation="After the prompt, each step adds one token per running request: TPOT is the "
                    "decode speed a streaming user sees.",
        mistakes=[
            Mistake(f"that divides the whole E2E by all {n} tokens, so the first token's wait (the "
                    "prefill) is spread over the others; TPOT leaves the first token out.",
                    value=lambda: 1000 * row.e2e_s / n),
            Mistake(f"that divides by {n} gaps; {n} tokens have {n - 1} gaps between them.",
                    value=lambda: 1000 * (row.e2e_s - row.ttft_s) / n, rel_tol=0.005),
            Mistake("that is the TTFT; TPOT is about the tokens after the first.",
                    value=lambda: 1000 * row.ttft_s),
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
