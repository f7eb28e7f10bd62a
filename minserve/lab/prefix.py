"""Workloads whose prompts share a prefix, and what the prefix cache did with them.

Real traffic repeats itself at the start of the prompt: an agent's system prompt and tool
definitions, a company's policy preamble, the same retrieved document for several questions.
With automatic prefix caching (:mod:`minserve.engine.kv_cache`) the KV blocks of such a prefix are
computed once and then reused, so a later request only prefills what is new. Whether a workload
benefits is a measurement, not a setting: the engine counts prompt tokens looked up in the cache
(``vllm:prefix_cache_queries``) and tokens found (``vllm:prefix_cache_hits``), per step in
``steps_frame()`` and per request in ``num_cached_tokens``.

- :func:`shared_prefix_requests` builds requests that start with one shared text (or none);
- :func:`cold_warm_pairs` times cold against warm requests in repeated pairs (a calibration: the
  first pair is dropped, the median of the rest kept, with its spread);
- :func:`prefix_experiment` runs such a workload (the function the lab's control panel calls);
- :func:`cache_report` sums the run's cache counters (queries, hits, hit rate, requests that hit);
- :func:`cache_counters` reads the engine's two Prometheus counters, for before/after deltas;
- :func:`common_prefix_tokens` counts the token ids two prompts share at the start.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

_seeds = itertools.count(10_000)


def common_prefix_tokens(a: Sequence[int], b: Sequence[int]) -> int:
    """How many token ids ``a`` and ``b`` share at the start."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def cache_counters(llm) -> dict[str, float]:
    """The engine's prefix-cache counters (``vllm:prefix_cache_queries`` and ``_hits``, in tokens,
    since the engine started): take them before and after a run and subtract.

    ``llm`` may be the lab's :class:`~minserve.lab.target.RemoteLLM` (the target is a server):
    the same two counters then come from the server's ``/metrics`` (``..._total``, vLLM's names,
    with the target's key). They count every client's requests: on a shared server the deltas
    include the neighbours' traffic. A server that does not show its ``/metrics`` to this key (a
    workshop participant's key gets 403) gives NaN for both, with one line saying why."""
    base = getattr(llm, "base_url", None)
    if base is not None:
        return _server_counters(base, getattr(llm, "target", None))
    snap = getattr(llm, "llm_engine", llm).snapshot()
    return {"queries": float(snap.get("vllm:prefix_cache_queries", 0.0)),
            "hits": float(snap.get("vllm:prefix_cache_hits", 0.0))}


def _server_counters(base_url: str, target=None) -> dict[str, float]:
    import httpx

    from minserve.bench.server_metrics import parse_metrics_text
    headers = target.headers() if target is not None else {}
    try:
        resp = httpx.get(f"{base_url.rstrip('/')}/metrics", headers=headers, timeout=10)
        status = resp.status_code
    except httpx.HTTPError as e:
        status = type(e).__name__
    if status != 200:
        print(f"{base_url}/metrics answered {status}: no prefix-cache counters from this server "
              "(a server with keys shows them to an admin key only)")
        return {"queries": math.nan, "hits": math.nan}
    values = parse_metrics_text(resp.text)
    return {"queries": values["prefix_cache_queries_total"], "hits": values["prefix_cache_hits_total"]}


def shared_prefix_requests(tokenizer, num_requests: int, prompt_tokens: int, output_tokens: int,
                           shared_tokens: int = 0, preamble: str = "", seed: int = 0,
                           label: str | None = None, seam: str = "\n\nRequest:"):
    """``num_requests`` requests of ``prompt_tokens`` tokens that all start with one shared text:
    ``preamble``, documentation text up to ``shared_tokens`` tokens, then ``seam``. The rest of
    each prompt is its own (a different passage per request). ``shared_tokens=0``: every prompt
    is unique. Returns (requests, shared_text).

    Why the seam: a tokenizer merges characters across the join (a run of spaces and newlines is
    one token), so text glued straight after the shared part could change its last tokens from
    one request to the next. The seam ends in ``:`` followed by a space, which no following text
    can merge with, so every request shares the same token ids up to the seam."""
    from minserve.lab.workload import make_requests, text_of_length
    if not 0 <= shared_tokens < prompt_tokens:
        raise ValueError(f"shared_tokens must be in [0, prompt_tokens) = [0, {prompt_tokens}), "
                         f"got {shared_tokens}")
    shared = (text_of_length(tokenizer, shared_tokens, seed=seed, prefix=preamble) + seam
              if shared_tokens else "")
    name = label or ("shared prefix" if shared_tokens else "unique")
    reqs = make_requests(tokenizer, prompt_tokens, output_tokens, num_requests,
                         labels=[name] * num_requests, seed=seed + 1,
                         prefixes=[shared + " "] * num_requests if shared else None)
    return reqs, shared


def cold_warm_pair(llm, tokenizer, prompt_tokens: int, shared_tokens: int, preamble: str = "", *,
                   output_tokens: int = 8, seed: int = 0, seam: str = "\n\nRequest:") -> dict:
    """One timed pair on ``llm`` (nothing else running): a request whose first ``shared_tokens``
    the cache has never seen (cold), then one that shares them (warm). The shared text starts with
    a line naming ``seed`` ("Deployment 7."), so each pair's first block, hence every block after
    it (the keys are chained), is new to the cache even when ``preamble`` is not. Returns both
    TTFTs (from the engine's records) and the engine's token counts."""
    from minserve import SamplingParams
    (cold_req, warm_req), _ = shared_prefix_requests(
        tokenizer, 2, prompt_tokens, output_tokens, shared_tokens, f"Deployment {seed}.\n" + preamble,
        seed=seed, seam=seam)
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    cold = llm.generate([cold_req.prompt], params, use_tqdm=False)[0]
    warm = llm.generate([warm_req.prompt], params, use_tqdm=False)[0]
    return {"pair": seed, "cold_ttft_s": cold.metrics.ttft_s, "warm_ttft_s": warm.metrics.ttft_s,
            "cold_prompt_tokens": len(cold.prompt_token_ids),
            "cold_prefilled": len(cold.prompt_token_ids) - int(cold.num_cached_tokens or 0),
            "warm_prompt_tokens": len(warm.prompt_token_ids),
            "warm_cached": int(warm.num_cached_tokens or 0),
            "warm_prefilled": len(warm.prompt_token_ids) - int(warm.num_cached_tokens or 0)}


def cold_warm_pairs(llm, tokenizer, prompt_tokens: int, shared_tokens: int, preamble: str = "", *,
                    output_tokens: int = 8, seed: int = 0, seam: str = "\n\nRequest:",
                    repeats: int = 3, max_runs: int = 6, tolerance: float = 0.2, echo: bool = True):
    """Cold against warm TTFT, measured the way a timing lesson needs it on a busy machine:
    :func:`cold_warm_pair` repeated under :func:`minserve.lab.hygiene.calibrate` (the first pair
    is dropped as warm-up, pairs are added until the last ``repeats`` agree on the TTFT the cache
    saved, cold - warm, within ``tolerance``, or ``max_runs`` pairs were made). One pair is a cold
    and a warm request back to back, so a slow minute of the machine slows both.

    Returns (frame, calibration): one row per pair with ``kept`` marking the pairs the
    calibration's median is taken over; ``calibration.load`` is the load during all pairs."""
    import pandas as pd

    from minserve.lab.hygiene import calibrate
    rows: list[dict] = []

    def one_pair() -> float:
        rows.append(cold_warm_pair(llm, tokenizer, prompt_tokens, shared_tokens, preamble,
                                   output_tokens=output_tokens, seed=seed + len(rows), seam=seam))
        return rows[-1]["cold_ttft_s"] - rows[-1]["warm_ttft_s"]

    cal = calibrate(one_pair, name="TTFT the cache saved per pair (cold - warm)", repeats=repeats,
                    max_runs=max_runs, tolerance=tolerance, echo=echo)
    frame = pd.DataFrame(rows)
    frame["kept"] = False
    frame.loc[frame.index[-len(cal.kept):], "kept"] = True
    return frame, cal


def prefix_experiment(preset=None, *, num_requests: int = 8, request_rate: float = math.inf,
                      max_concurrency: int | None = None, prompt_tokens: int = 352,
                      output_tokens: int = 8, shared_fraction: float = 0.9, preamble: str = "",
                      seed: int | None = None, max_num_seqs: int | None = None,
                      max_num_batched_tokens: int | None = None, num_kv_blocks: int | None = None,
                      enable_prefix_caching: bool = True, live: bool = True, name: str | None = None):
    """One run of ``num_requests`` prompts of ``prompt_tokens`` tokens whose first
    ``shared_fraction`` is shared (0: all unique), on the engine :func:`engine_for` gives for
    these settings. ``seed`` None picks a new one each call, so the shared text is cold (not yet
    cached) at the start of every run; pass a seed to rerun the same text warm. Returns the
    :class:`~minserve.lab.workload.RunResult`; :func:`cache_report` summarises its cache use."""
    from minserve.lab.session import engine_for
    from minserve.lab.workload import run_workload
    if not 0 <= shared_fraction < 1:
        raise ValueError(f"shared_fraction must be in [0, 1), got {shared_fraction}")
    llm = engine_for(preset, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     num_kv_blocks=num_kv_blocks, enable_prefix_caching=enable_prefix_caching)
    seed = next(_seeds) if seed is None else seed
    shared_tokens = int(round(shared_fraction * prompt_tokens))
    reqs, _ = shared_prefix_requests(llm.get_tokenizer(), num_requests, prompt_tokens, output_tokens,
                                     shared_tokens, preamble, seed=seed * 7)
    label = name or (f"{num_requests} x {prompt_tokens} tokens, {shared_tokens} shared, "
                     f"cache {'on' if enable_prefix_caching else 'off'}")
    return run_workload(llm, reqs, request_rate=request_rate, max_concurrency=max_concurrency,
                        seed=seed, live=live, name=label)


def cache_report(run) -> dict[str, float]:
    """The run's prefix-cache use from the engine's step records: ``queries`` (prompt tokens looked
    up), ``hits`` (tokens served from the cache, i.e. prefill skipped), ``hit_rate`` (hits /
    queries), ``computed`` (queries - hits: prompt tokens that had to be prefilled; the steps'
    ``num_prefill_tokens`` can differ by a token per request, since a final one-token chunk is
    counted with the decodes, and by any recompute after a preemption), ``requests_with_hits``
    (requests whose ``cached_tokens`` > 0) and ``requests``."""
    run.require_engine("cache_report")
    st, rq = run.steps, run.requests
    queries = float(st.prefix_cache_queries.sum())
    hits = float(st.prefix_cache_hits.sum())
    return {"queries": queries, "hits": hits,
            "hit_rate": hits / queries if queries else math.nan,
            "computed": queries - hits,
            "requests_with_hits": int((rq.cached_tokens > 0).sum()), "requests": int(len(rq))}
