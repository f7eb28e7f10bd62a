"""The deadline model: if a request were admitted now, when would its answer be complete?

Admission (admission.py) sheds a request with a deadline (``x-deadline-ms``) when this prediction
misses it, so the model is deliberately simple and stated here, to keep the shedding explainable.

The engine has ``slots`` seats (``max_num_seqs``). A request generates only while it holds a seat,
and the waiting requests take seats in arrival order as they free (the scheduler is first come,
first served). So a request arriving while every seat is busy with a long generation cannot start
until one of those ends, however small it is: with 16 sequences each allowed 4 k more tokens, its
own 2 s of work comes after minutes of waiting. The work ahead of a new request is

- each request the engine runs (reported by the engine thread after every step): prompt tokens
  still to compute (``prefill_left``) and output tokens it may still produce
  (``decode_left = max_tokens - generated``); the first ``slots`` of them hold seats, any others
  (preempted, waiting to recompute) queue first;
- then the admitted requests still queued, oldest first: their prompt tokens and max_tokens.

With ``p`` = seconds of prefill per prompt token and ``d`` = seconds per output token of one
decoding request (both measured from recent steps by admission), a request holds its seat for
``prefill_left * p + decode_left * d``. ``d`` is a decode step's time over the tokens a decoding
request gains in a step: one without speculative decoding (then ``d`` is the step time), 1 + its
accepted proposals with it; the model counts output tokens, never steps, so it holds either way.
Then::

    seat_free     = when a seat frees for the new request: seats start busy until their running
                    request is done; each request queued ahead takes the earliest free seat in
                    turn and holds it for its own time (simulated with a heap of free times)
    prefill_ahead = (prefill_left of all running + prompt tokens of all queued) * p
                    (prompts share each step's token budget, first come first served, so the
                    prompts ahead are computed before the new one, whichever seats they use)
    start         = max(seat_free, prefill_ahead)
    predicted     = start + own prompt_tokens * p + own max_tokens * d

What it leaves out, on purpose: output lengths are counted at ``max_tokens``, the only bound known
in advance (answers that stop early at EOS make it pessimistic: send a tight ``max_tokens`` with a
tight deadline); a batch's effect on step time is not modelled but is inside the measured ``d``;
preemption and prefix-cache hits are ignored.
"""

from __future__ import annotations

import heapq
from typing import Iterable, Sequence

Work = tuple[int, int]  # (prompt tokens left to compute, output tokens left at most)


def start_s(running: Sequence[Work], queued: Iterable[Work], slots: int,
            prefill_s_per_token: float, decode_s_per_token: float) -> float:
    """Seconds from now until a request admitted now could start (see the module docstring)."""
    p, d = prefill_s_per_token, decode_s_per_token
    seats = [pf * p + dc * d for pf, dc in running[:slots]]
    seats += [0.0] * (slots - len(seats))
    heapq.heapify(seats)
    prefill_tokens = 0
    for pf, dc in list(running[slots:]) + list(queued):
        # The earliest free seat takes the next request in line and stays busy for its work.
        heapq.heapreplace(seats, seats[0] + pf * p + dc * d)
        prefill_tokens += pf
    prefill_tokens += sum(pf for pf, _ in running[:slots])
    return max(seats[0], prefill_tokens * p)


def finish_s(start: float, prompt_tokens: int, max_tokens: int, prefill_s_per_token: float,
             decode_s_per_token: float) -> float:
    """Seconds from now until the request is done, if it starts ``start`` seconds from now."""
    return start + prompt_tokens * prefill_s_per_token + max_tokens * decode_s_per_token
