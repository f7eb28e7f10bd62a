"""What TTFT, TPOT, ITL and E2E mean: the one home of the latency definitions.

Every number called by these names is computed here: ``RequestOutput.metrics``
(:mod:`minserve.outputs`), the ``vllm:*`` histograms (:mod:`minserve.metrics.prometheus`), the
requests frame (:mod:`minserve.metrics.frames`) and the benchmark (:mod:`minserve.bench`). Each of
them only decides where its times come from (the engine's timeline, a streamed chunk, a step
output); the arithmetic, and so the meaning, is shared, so a notebook, a dashboard and a
benchmark report of the same run agree.

The definitions are vLLM's (``vllm/v1/metrics/stats.py`` for the server, ``vllm bench serve``
for the client):

- **TTFT** = first output token - arrival (for a client: first token-carrying chunk - send). It
  holds the queueing and the whole prefill: what a user waits before anything appears.
- **E2E** = finish - arrival.
- **TPOT** = (last token - first token) / (output tokens - 1): the mean time per output token
  after the first. Undefined (None) for fewer than two tokens: there is no "after the first".
- **ITL** = the gap between two successive *emissions* of one request.

An *emission* is one moment at which a request received new output tokens: one engine step, one
streamed chunk. Usually it brings one token, but speculative decoding accepts several tokens in
one step, and they reach the timeline with the same timestamp. Tokens that arrived together have
no latency between them: counting 0 s gaps would claim those tokens were free and drag every ITL
percentile towards zero, while the user saw the text arrive in bursts. So ITLs are taken between
distinct times, and with k tokens per step an ITL is about k * TPOT. TPOT still divides by
tokens, so it keeps measuring how fast text grows (what speculative decoding improves).

Times are plain floats (seconds, any one clock); None marks an event that has not happened, and
every function returns None when its answer is undefined. Callers turn None into NaN or 0 as
their format needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def elapsed_s(start: float | None, end: float | None) -> float | None:
    """``end - start``, or None when either event is missing."""
    return None if start is None or end is None else end - start


def ttft_s(arrival: float | None, first_token: float | None) -> float | None:
    """Time to first token: first output token (or token-carrying chunk) minus arrival (send)."""
    return elapsed_s(arrival, first_token)


def e2e_s(arrival: float | None, finished: float | None) -> float | None:
    """End-to-end latency: finish minus arrival."""
    return elapsed_s(arrival, finished)


def tpot_s(first_token: float | None, last_token: float | None, num_tokens: int) -> float | None:
    """Time per output token after the first: (last - first) / (tokens - 1); None below 2 tokens.

    ``num_tokens`` counts tokens, not emissions: three tokens accepted in one step are three
    tokens of output, produced in that step's time."""
    if num_tokens < 2:
        return None
    span = elapsed_s(first_token, last_token)
    return None if span is None else span / (num_tokens - 1)


def emission_times(token_times: Sequence[float]) -> list[float]:
    """The distinct moments at which tokens arrived, in order: one per step / chunk.

    ``token_times`` has one entry per output token (``RequestTimeline.token_s``); tokens that
    came in the same step share their step's time and collapse into one emission here."""
    out: list[float] = []
    for t in token_times:
        if not out or t != out[-1]:
            out.append(t)
    return out


def itls_s(token_times: Sequence[float]) -> list[float]:
    """Inter-token latencies: the gaps between successive emissions (never a 0 s gap between
    tokens that arrived together). Empty for fewer than two emissions."""
    times = emission_times(token_times)
    return [b - a for a, b in zip(times, times[1:])]


def step_itl_s(token_times: Sequence[float], num_new: int) -> float | None:
    """The ITL of the latest emission, which brought the last ``num_new`` of ``token_times``:
    its time minus the time of the token before it. None when those are the request's first
    tokens (that emission is its TTFT, not an ITL).

    Observing this once per step that brought tokens gives, over a request's life, exactly
    :func:`itls_s` of its timeline (vLLM v1 also records inter-token latency per iteration)."""
    if num_new < 1 or len(token_times) <= num_new:
        return None
    return token_times[-1] - token_times[-1 - num_new]


@dataclass(frozen=True)
class RequestLatencies:
    """All latencies of one request timeline (``RequestTimeline`` of a live request or record).

    Besides the four above: queue = first scheduled - arrival; prefill = first token - first
    scheduled; decode = last token - first token (all three contain any preemption that fell in
    them). ``e2e_s`` is None until the request has finished."""
    num_tokens: int
    queue_s: float | None
    ttft_s: float | None
    prefill_s: float | None
    decode_s: float | None
    e2e_s: float | None
    tpot_s: float | None
    itls_s: list[float] = field(default_factory=list)


def timeline_latencies(timeline) -> RequestLatencies:
    """The latencies of a ``RequestTimeline`` (arrival_s, scheduled_s, token_s, finished_s)."""
    times = timeline.token_s
    n = len(times)
    first, last = (times[0], times[-1]) if n else (None, None)
    sched = timeline.scheduled_s[0] if timeline.scheduled_s else None
    arrival = timeline.arrival_s
    return RequestLatencies(
        num_tokens=n, queue_s=elapsed_s(arrival, sched), ttft_s=ttft_s(arrival, first),
        prefill_s=elapsed_s(sched, first), decode_s=elapsed_s(first, last),
        e2e_s=e2e_s(arrival, timeline.finished_s), tpot_s=tpot_s(first, last, n),
        itls_s=itls_s(times))
