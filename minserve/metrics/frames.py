"""Requests and steps as pandas DataFrames, for plotting and answering lab questions.

The frames are built from the same records the Prometheus metrics come from (request timelines and
per-step StepStats), so a histogram on the dashboard and a ``df.ttft_s.describe()`` in a notebook
agree. The latencies come from :mod:`minserve.metrics.latency`, where they are defined.

pandas is imported inside the functions: it is an optional extra for the labs, and the engine must
import without it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Iterable

from minserve.metrics.latency import timeline_latencies

if TYPE_CHECKING:
    import pandas as pd

    from minserve.engine.stats import StepStats
    from minserve.engine.request import Request, RequestRecord

NAN = math.nan

REQUEST_COLUMNS = [
    "request_id", "status", "finish_reason", "prompt_tokens", "output_tokens", "cached_tokens",
    "num_preemptions", "spec_proposed", "spec_accepted", "acceptance_rate", "arrival_s", "first_scheduled_s", "first_token_s", "finished_s",
    "queue_s", "ttft_s", "prefill_s", "decode_s", "e2e_s", "tpot_s", "itl_mean_s", "itl_max_s",
    "token_times_s",
]


def _rel(t: float | None, t0_s: float) -> float:
    return NAN if t is None else t - t0_s


def _nan(v: float | None) -> float:
    return NAN if v is None else v


def requests_frame(requests: Iterable[Request | RequestRecord], t0_s: float) -> pd.DataFrame:
    """One row per request (live requests, or the records finished ones leave behind).

    ``t0_s`` is the engine's start (``engine.start_s``, perf_counter seconds); every ``*_s`` time
    column is seconds since then, so requests line up with :func:`steps_frame`. NaN marks what is
    undefined (no token yet, never scheduled, still running).

    Columns:
      request_id; status (``waiting``, ``running``, ``preempted``, ``stop``, ``length``, ``abort``,
      ``error``); finish_reason (the final status, None while unfinished);
      prompt_tokens, output_tokens; cached_tokens (prompt tokens served from the prefix cache);
      num_preemptions; spec_proposed, spec_accepted (speculative decoding: proposals verified for
      it and accepted), acceptance_rate = accepted / proposed (NaN without proposals);
      arrival_s, first_scheduled_s, first_token_s, finished_s (events, since t0_s);
      queue_s = first scheduled - arrival; ttft_s = first token - arrival;
      prefill_s = first token - first scheduled; decode_s = last token - first token;
      e2e_s = finished - arrival;
      tpot_s = decode_s / (output tokens - 1), for two or more tokens: this request's mean time
      per token after the first;
      itl_mean_s, itl_max_s: mean and largest gap between successive emissions (steps that
      brought tokens; a preemption shows as a large itl_max_s). With one token per step
      itl_mean_s equals tpot_s; when a step brings several tokens (speculative decoding) it is
      that many times larger. The pooled ITL histogram weights every gap equally, so long
      requests count more there;
      token_times_s: list of each output token's time, since t0_s (tokens of one step repeat it).
    Definitions: :mod:`minserve.metrics.latency`.
    """
    import pandas as pd

    rows = []
    for req in requests:
        tl = req.timeline
        times = tl.token_s
        lat = timeline_latencies(tl)
        gaps = lat.itls_s
        rows.append({
            "request_id": req.request_id,
            "status": req.status.value,
            "finish_reason": req.finish_reason,
            "prompt_tokens": req.num_prompt_tokens,
            "output_tokens": req.num_output_tokens,
            "cached_tokens": req.num_cached_tokens,
            "num_preemptions": req.num_preemptions,
            "spec_proposed": req.num_spec_proposed,
            "spec_accepted": req.num_spec_accepted,
            "acceptance_rate": (req.num_spec_accepted / req.num_spec_proposed
                                if req.num_spec_proposed else NAN),
            "arrival_s": tl.arrival_s - t0_s,
            "first_scheduled_s": _rel(tl.first_scheduled_s, t0_s),
            "first_token_s": _rel(tl.first_token_s, t0_s),
            "finished_s": _rel(tl.finished_s, t0_s),
            "queue_s": _nan(lat.queue_s),
            "ttft_s": _nan(lat.ttft_s),
            "prefill_s": _nan(lat.prefill_s),
            "decode_s": _nan(lat.decode_s),
            "e2e_s": _nan(lat.e2e_s),
            "tpot_s": _nan(lat.tpot_s),
            "itl_mean_s": sum(gaps) / len(gaps) if gaps else NAN,
            "itl_max_s": max(gaps) if gaps else NAN,
            "token_times_s": [t - t0_s for t in times],
        })
    return pd.DataFrame(rows, columns=REQUEST_COLUMNS)


def _step_fields() -> list[str]:
    from minserve.engine.stats import StepStats
    return [f.name for f in dataclasses.fields(StepStats)]


def steps_frame(steps: Iterable[StepStats]) -> pd.DataFrame:
    """One row per engine step (``engine.step_stats``).

    Columns: every StepStats field, as recorded —
      step (index), start_s (seconds since engine start), step_time_s (wall time of the step),
      num_prefill_tokens, num_decode_tokens (tokens computed, by kind), num_running, num_waiting
      (queue lengths after the step), kv_cache_usage (fraction of KV blocks in use after the step,
      1.0 = full), num_preemptions (in this step), prefix_cache_queries / prefix_cache_hits (prompt
      tokens looked up / found in the prefix cache in this step), prefill_chunks —
    plus end_s = start_s + step_time_s and tokens = num_prefill_tokens + num_decode_tokens
    (the step's batch size in tokens; tokens / step_time_s is its throughput).
    """
    import pandas as pd

    rows = [dataclasses.asdict(s) for s in steps]
    if not rows:
        # Keep the columns of an empty run so notebook code (df.tokens.sum()) still works.
        return pd.DataFrame(columns=_step_fields() + ["end_s", "tokens"])
    df = pd.DataFrame(rows)
    df["end_s"] = df["start_s"] + df["step_time_s"]
    df["tokens"] = df["num_prefill_tokens"] + df["num_decode_tokens"]
    return df
