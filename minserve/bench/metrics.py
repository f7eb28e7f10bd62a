"""Benchmark metrics, computed exactly as ``vllm bench serve`` computes them.

Both backends (the HTTP client and the in-process engine driver) fill one
:class:`RequestRecord` per request and hand the list to :func:`calculate_metrics`, so a number
from a notebook run and one from a run against a vLLM server mean the same thing.

Per request, all client-side and in seconds, with the definitions of
:mod:`minserve.metrics.latency` applied to what the client sees. An *emission* is a streamed chunk
that carries output (text, or a token with no text such as a special token); role-only,
finish-only and usage chunks are not emissions.
- TTFT: from sending the request to its first emission.
- ITL: the gaps between successive emissions (one per token when the server streams each token;
  a chunk holding several tokens, e.g. a speculative-decoding step, gives one longer gap).
- E2EL (``latency``): from sending the request to its last chunk carrying choices (usually the
  one with ``finish_reason``), as vLLM's client measures it.
- TPOT: ``(latency - ttft) / (output_len - 1)`` for ``output_len > 1`` (latency standing in for
  the last token, as in vLLM); requests with one token have no TPOT (they count as 0 for
  goodput, as in vLLM).
- output_len: the server's ``usage.completion_tokens`` when it reports one, else the token count of
  the generated text (which can differ slightly: text does not always re-tokenize to the same ids).

Over the run (``duration`` = first send to last response): request / output / total-token
throughput = completed requests, output tokens, input + output tokens per second; goodput =
requests that meet every SLO given (``ttft``, ``tpot``, ``e2el`` in ms, inclusive) per second.
Means, medians, standard deviations (population, numpy's default) and percentiles (numpy's linear
interpolation) are over successful requests; ITL statistics pool every gap of every request, so
long outputs weigh more there than in TPOT. An empty list gives 0 for every statistic (vLLM's
``np.mean(x or 0)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minserve.metrics import latency as lat

MS_PER_S = 1000.0
METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
GOODPUT_NAMES = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILE_METRICS = "ttft,tpot,itl"


@dataclass
class RequestRecord:
    """What one request did, seen from the client (vLLM's ``RequestFuncOutput`` plus ids)."""
    request_id: str = ""
    scenario: str = ""
    prompt_len: int = 0
    expected_output_len: int = 0
    scheduled_s: float = 0.0          # planned send time, seconds after the run started
    start_time: float = 0.0           # perf_counter() when actually sent
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0            # server-reported completion tokens; 0 = not reported
    generated_text: str = ""
    success: bool = False
    error: str = ""
    # Ours, not vLLM's: who answered and what the prefix cache gave. ``response_id`` is the
    # server's completion id (the engine's request id in process); ``cached_tokens`` the prompt
    # tokens served from the prefix cache (usage.prompt_tokens_details.cached_tokens), None when
    # the server does not report it (vLLM only with --enable-prompt-tokens-details).
    response_id: str = ""
    cached_tokens: int | None = None


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    stats_ms: dict[str, dict[str, float]]          # metric -> {"mean", "median", "std", "pNN"}
    max_output_tokens_per_s: float = 0.0
    max_concurrent_requests: int = 0


def set_latencies(rec: RequestRecord, emissions: list[float], end: float) -> None:
    """Fill ``rec``'s TTFT, ITLs and E2EL from the times of its emissions and of its last chunk
    (same clock as ``rec.start_time``); the one path both backends take."""
    rec.ttft = lat.ttft_s(rec.start_time, emissions[0])
    rec.itl = lat.itls_s(emissions)
    rec.latency = lat.e2e_s(rec.start_time, end)


def request_tpot(rec: RequestRecord, n: int) -> float | None:
    """TPOT of a successful request with ``n`` output tokens; None below two tokens."""
    return lat.tpot_s(rec.ttft, rec.latency, n)


def percentile_key(p: float) -> str:
    """99 -> "p99", 99.9 -> "p99.9" (vLLM's key spelling)."""
    return f"p{int(p)}" if float(p) == int(p) else f"p{p}"


def summarize_ms(values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    data = values_s or 0  # vLLM's convention: no samples -> every statistic is 0
    out = {"mean": float(np.mean(data)) * MS_PER_S, "median": float(np.median(data)) * MS_PER_S,
           "std": float(np.std(data)) * MS_PER_S}
    for p in percentiles:
        out[percentile_key(p)] = float(np.percentile(data, p)) * MS_PER_S
    return out


def output_len(rec: RequestRecord, tokenizer=None) -> int:
    """Output tokens of a successful request (see the module docstring for the fallback)."""
    if rec.output_tokens:
        return int(rec.output_tokens)
    if tokenizer is not None:
        return len(tokenizer(rec.generated_text, add_special_tokens=False).input_ids)
    # No usage and no tokenizer: one token per content chunk is the best remaining guess.
    return len(rec.itl) + 1 if rec.generated_text else 0


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        try:
            slos[name] = float(value) if sep else float("nan")
        except ValueError:
            slos[name] = float("nan")
        if name not in GOODPUT_NAMES:
            raise ValueError(f"goodput metric must be one of {', '.join(GOODPUT_NAMES)}, got {pair!r}")
        if not slos[name] >= 0:
            raise ValueError(f"goodput must be KEY:VALUE with VALUE a number of ms >= 0, got {pair!r}")
    return slos


def _is_good(ttft: float, tpot: float, e2el: float, slos_ms: dict[str, float]) -> bool:
    got = {"ttft": ttft, "tpot": tpot, "e2el": e2el}
    return all(got[k] <= v / MS_PER_S for k, v in slos_ms.items())


def _peak_output_rate(ok: list[RequestRecord]) -> tuple[float, int]:
    """Most output chunks in any one-second bucket, and most requests active in a bucket."""
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    n = int(np.ceil(max(r.start_time + r.latency for r in ok) - t0)) + 1
    tokens, active = np.zeros(n), np.zeros(n)
    for r in ok:
        times = r.start_time + r.ttft + np.concatenate([[0.0], np.cumsum(r.itl)])
        np.add.at(tokens, np.clip((times - t0).astype(int), 0, n - 1), 1)
        active[int(r.start_time - t0):int(r.start_time + r.latency - t0) + 1] += 1
    return float(tokens.max()), int(active.max())


def calculate_metrics(records: list[RequestRecord], duration_s: float, tokenizer=None,
                      percentiles: list[float] = (99,),
                      goodput_ms: dict[str, float] | None = None) -> tuple[BenchmarkMetrics, list[int]]:
    """Run-level metrics and each request's output length (0 for failed requests)."""
    lens: list[int] = []
    ttfts, tpots, itls, e2els = [], [], [], []
    good = 0
    for rec in records:
        if not rec.success:
            lens.append(0)
            continue
        n = output_len(rec, tokenizer)
        lens.append(n)
        tpot = request_tpot(rec, n)
        if tpot is not None:
            tpots.append(tpot)
        else:
            tpot = 0.0  # vLLM's convention: a one-token request passes any TPOT SLO
        ttfts.append(rec.ttft)
        itls.extend(rec.itl)
        e2els.append(rec.latency)
        good += bool(goodput_ms) and _is_good(rec.ttft, tpot, rec.latency, goodput_ms)
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(lens)
    peak_tokens, peak_active = _peak_output_rate(ok)
    stats = {name: summarize_ms(vals, list(percentiles))
             for name, vals in zip(METRIC_NAMES, (ttfts, tpots, itls, e2els))}
    return BenchmarkMetrics(
        completed=len(ok), failed=len(records) - len(ok), total_input=total_in,
        total_output=total_out, request_throughput=len(ok) / duration_s,
        request_goodput=good / duration_s, output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s, stats_ms=stats,
        max_output_tokens_per_s=peak_tokens, max_concurrent_requests=peak_active), lens


def result_dict(records: list[RequestRecord], m: BenchmarkMetrics, lens: list[int],
                duration_s: float, meta: dict, percentile_metrics: list[str],
                goodput_ms: dict[str, float] | None) -> dict:
    """The result JSON of ``vllm bench serve --save-result --save-detailed``, key for key.

    ``meta`` supplies date, backend, model_id, tokenizer_id, num_prompts, request_rate,
    burstiness and max_concurrency; unknown metric names in ``percentile_metrics`` are rejected.
    """
    bad = [k for k in percentile_metrics if k not in METRIC_NAMES]
    if bad:
        raise ValueError(f"percentile_metrics must name only {', '.join(METRIC_NAMES)}, got {bad}")
    out = dict(meta)
    out.update({
        "duration": duration_s, "completed": m.completed, "failed": m.failed,
        "total_input_tokens": m.total_input, "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput if goodput_ms else None,
        "output_throughput": m.output_throughput, "total_token_throughput": m.total_token_throughput,
        "input_lens": [r.prompt_len for r in records], "output_lens": list(lens),
        "ttfts": [r.ttft for r in records], "itls": [list(r.itl) for r in records],
        "generated_texts": [r.generated_text for r in records], "errors": [r.error for r in records],
        "max_output_tokens_per_s": m.max_output_tokens_per_s,
        "max_concurrent_requests": m.max_concurrent_requests,
    })
    for name in METRIC_NAMES:
        if name in percentile_metrics:
            for stat, value in m.stats_ms[name].items():
                out[f"{stat}_{name}_ms"] = value
    return out
