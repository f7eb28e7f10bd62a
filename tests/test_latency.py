"""The latency definitions (minserve.metrics.latency) and the places that must agree with them.

Times are multiples of 0.25 s so every expected value is exact in binary floating point.
"""

from __future__ import annotations

import json

import pytest

from minserve.engine.request import RequestTimeline
from minserve.metrics import latency as lat
from minserve.outputs import RequestMetrics


def test_scalar_definitions():
    assert lat.ttft_s(10.0, 10.5) == 0.5 and lat.ttft_s(10.0, None) is None
    assert lat.e2e_s(10.0, 12.0) == 2.0 and lat.e2e_s(None, 12.0) is None
    assert lat.tpot_s(10.5, 11.5, 5) == 0.25
    # Fewer than two tokens: no "per output token after the first".
    assert lat.tpot_s(10.5, 10.5, 1) is None and lat.tpot_s(None, None, 0) is None


def test_one_token_per_step():
    times = [1.0, 1.25, 1.75, 2.0]
    assert lat.emission_times(times) == times
    assert lat.itls_s(times) == [0.25, 0.5, 0.25]
    assert lat.tpot_s(times[0], times[-1], len(times)) == pytest.approx(1.0 / 3)
    # Observed step by step, the ITLs are the same as from the whole timeline.
    assert [lat.step_itl_s(times[:k], 1) for k in range(1, 5)] == [None, 0.25, 0.5, 0.25]


def test_several_tokens_in_one_step():
    # Steps at 1.0 (1 token: the prefill), 1.5 (3 accepted tokens), 2.0 (2 tokens), 2.25 (1).
    times = [1.0, 1.5, 1.5, 1.5, 2.0, 2.0, 2.25]
    assert lat.emission_times(times) == [1.0, 1.5, 2.0, 2.25]
    itls = lat.itls_s(times)
    assert itls == [0.5, 0.5, 0.25] and 0.0 not in itls   # no gap between tokens that came together
    # TPOT still divides by tokens: 1.25 s for the 6 tokens after the first.
    assert lat.tpot_s(times[0], times[-1], len(times)) == pytest.approx(1.25 / 6)
    # The per-step form: the steps that brought 1, 3, 2 and 1 tokens.
    grown, observed = [], []
    for t, k in [(1.0, 1), (1.5, 3), (2.0, 2), (2.25, 1)]:
        grown += [t] * k
        observed.append(lat.step_itl_s(grown, k))
    assert observed == [None] + itls
    # A first step that brings several tokens at once is still the TTFT, not an ITL.
    assert lat.step_itl_s([3.0, 3.0], 2) is None and lat.step_itl_s([], 0) is None


def test_timeline_latencies():
    tl = RequestTimeline(arrival_s=0.0, scheduled_s=[0.25, 1.5], preempted_s=[1.25],
                         token_s=[1.0, 1.0, 2.0, 2.5, 2.5], finished_s=2.75)
    got = lat.timeline_latencies(tl)
    assert (got.num_tokens, got.queue_s, got.ttft_s, got.prefill_s, got.decode_s, got.e2e_s) == (
        5, 0.25, 1.0, 0.75, 1.5, 2.75)
    assert got.tpot_s == 1.5 / 4 and got.itls_s == [1.0, 0.5]
    running = lat.timeline_latencies(RequestTimeline(arrival_s=0.0, token_s=[0.5]))
    assert running.e2e_s is None and running.tpot_s is None and running.itls_s == []
    assert running.queue_s is None and running.prefill_s is None and running.ttft_s == 0.5


def test_request_metrics_use_the_definitions():
    m = RequestMetrics(arrival_time=100.0, last_token_time=102.0, first_scheduled_time=100.25,
                       first_token_time=101.0, time_in_queue=0.25, finished_time=102.25,
                       num_generation_tokens=5)
    assert (m.ttft_s, m.e2e_s) == (1.0, 2.25)
    assert m.tpot_s == 0.25   # (last token - first token) / 4, the finish bookkeeping left out
    m.finished_time = None   # while running, the last token stands in for the finish
    assert m.e2e_s == 2.0
    assert RequestMetrics(100.0, 101.0, 100.0, 101.0, 0.0, 101.0, 1).tpot_s is None
    assert RequestMetrics(100.0, None, None, None, None).ttft_s is None


# ---- the bench client: when TTFT starts -------------------------------------------------------

def _feed(stream, events):
    for t, data in events:
        stream.on_event(data if isinstance(data, str) else json.dumps(data), t)
    stream.finish()
    return stream.rec


def test_client_ttft_starts_at_the_first_chunk_with_output():
    """A fake SSE stream, read line by line as the client reads it: a ping first, then a
    role-only chunk long before the first content (a server that opens the stream at once)."""
    from minserve.bench.client import SSEReader, _Stream
    from minserve.bench.metrics import RequestRecord
    chunks = [
        (10.125, None),   # ": ping" comment: the first bytes, not a chunk
        (10.25, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        (11.0, {"choices": [{"index": 0, "delta": {"content": "Hel"}}]}),
        (11.5, {"choices": [{"index": 0, "delta": {"content": "lo"}}]}),
        (11.75, {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
        (12.0, {"choices": [], "usage": {"completion_tokens": 3}}),
        (12.25, "[DONE]"),
    ]
    stream, reader = _Stream(RequestRecord(start_time=10.0), chat=True), SSEReader()
    for t, data in chunks:
        payload = data if isinstance(data, str) else json.dumps(data)
        body = ": ping" if data is None else f"data: {payload}"
        for line in (body, ""):
            event = reader.feed(line)
            if event is not None:
                stream.on_event(event, t)
    stream.finish()
    rec = stream.rec
    assert rec.success and rec.generated_text == "Hello" and rec.output_tokens == 3
    assert rec.ttft == 1.0                 # not 0.25: the role-only chunk carries no token
    assert rec.itl == [0.5]                # neither role, finish nor usage chunks are gaps
    assert rec.latency == 1.75             # E2EL ends at the last chunk with choices (vLLM)


def test_client_counts_a_token_without_text_and_falls_back_without_any():
    from minserve.bench.client import _Stream
    from minserve.bench.metrics import RequestRecord
    # A special token: empty text, but its logprobs (or token ids) show a token arrived.
    rec = _feed(_Stream(RequestRecord(start_time=0.0), chat=False), [
        (0.5, {"choices": [{"index": 0, "text": "", "logprobs": {"tokens": ["<s>"]}}]}),
        (0.75, {"choices": [{"index": 0, "text": "hi", "token_ids": [7]}]}),
        (1.0, {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}),
    ])
    assert (rec.ttft, rec.itl, rec.latency) == (0.5, [0.25], 1.0)
    # Choices, but nothing that shows a token: the first chunk with choices is all there is.
    rec = _feed(_Stream(RequestRecord(start_time=0.0), chat=True), [
        (0.25, {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}),
        (0.5, {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
    ])
    assert rec.success and (rec.ttft, rec.itl, rec.latency) == (0.25, [], 0.5)
    rec = _feed(_Stream(RequestRecord(start_time=0.0), chat=True),
                [(0.5, {"choices": [], "usage": {"completion_tokens": 0}})])
    assert not rec.success and "without a single completion chunk" in rec.error


# ---- the Prometheus recorder, several tokens per step ------------------------------------------

def _stats(i):
    from minserve.engine.stats import StepStats
    return StepStats(step=i, start_s=0.25 * i, step_time_s=0.25, num_prefill_tokens=0,
                     num_decode_tokens=1, num_running=1, num_waiting=0, kv_cache_usage=0.5,
                     num_preemptions=0)


def test_recorder_takes_pairs_of_request_and_new_tokens():
    from minserve.engine.request import Request, RequestStatus
    from minserve.metrics import EngineMetrics
    from minserve.sampling_params import SamplingParams
    m = EngineMetrics("m")
    r = Request("r", None, [1, 2, 3, 4], SamplingParams(), 100.0, 16, [2])

    def step(i, t, k, done=False):
        r.timeline.token_s += [t] * k
        r.output_token_ids += [50] * k
        if done:
            r.status, r.timeline.finished_s = RequestStatus.FINISHED_LENGTH, t
        m.record_step(_stats(i), [(r, k)], [r] if done else [])

    step(0, 101.0, 2)             # the first step already brings two tokens: TTFT only
    step(1, 101.5, 3)
    step(2, 101.75, 1)
    m.record_step(_stats(3), [(r, 0)], [])   # scheduled, nothing accepted: no sample
    step(4, 102.25, 2, done=True)
    s = m.snapshot()
    assert s["vllm:generation_tokens"] == 8
    assert s["vllm:prompt_tokens"] == 4
    assert (s["vllm:time_to_first_token_seconds_count"],
            s["vllm:time_to_first_token_seconds_sum"]) == (1, 1.0)
    # One ITL per step that brought tokens after the first: 0.5, 0.25, 0.5; no zeros.
    assert (s["vllm:inter_token_latency_seconds_count"],
            s["vllm:inter_token_latency_seconds_sum"]) == (3, 1.25)
    assert s["vllm:request_time_per_output_token_seconds_sum"] == 1.25 / 7
    assert s["vllm:e2e_request_latency_seconds_sum"] == 2.25
    assert s["vllm:request_generation_tokens_sum"] == 8


def test_recorder_still_accepts_bare_requests():
    from minserve.engine.request import Request
    from minserve.metrics import EngineMetrics
    from minserve.sampling_params import SamplingParams
    m = EngineMetrics("m")
    r = Request("r", None, [1, 2], SamplingParams(), 0.0, 16, [2])
    for i, t in enumerate([0.5, 0.75, 1.25]):
        r.timeline.token_s.append(t)
        r.output_token_ids.append(9)
        m.record_step(_stats(i), [r], [])   # the one-token form: a bare request
    s = m.snapshot()
    assert s["vllm:generation_tokens"] == 3 and s["vllm:prompt_tokens"] == 2
    assert s["vllm:time_to_first_token_seconds_sum"] == 0.5
    assert (s["vllm:inter_token_latency_seconds_count"],
            s["vllm:inter_token_latency_seconds_sum"]) == (2, 0.75)


def test_frame_itls_agree_with_the_recorder():
    pytest.importorskip("pandas")
    from minserve.engine.request import Request, RequestStatus
    from minserve.metrics import requests_frame
    from minserve.sampling_params import SamplingParams
    r = Request("r", None, [1], SamplingParams(), 0.0, 16, [2])
    r.timeline.scheduled_s.append(0.25)
    r.timeline.token_s += [0.5, 1.0, 1.0, 1.0, 1.25]
    r.output_token_ids += [5] * 5
    r.status, r.timeline.finished_s = RequestStatus.FINISHED_STOPPED, 1.5
    row = requests_frame([r], 0.0).iloc[0]
    assert (row.ttft_s, row.itl_mean_s, row.itl_max_s) == (0.5, 0.375, 0.5)
    assert row.tpot_s == 0.75 / 4 and row.e2e_s == 1.5 and row.decode_s == 0.75
