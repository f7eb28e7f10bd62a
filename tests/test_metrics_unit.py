"""EngineMetrics and the frames, driven by a hand-made scenario (no model, no engine).

Times are multiples of 0.25 s so every expected sum is exact in binary floating point.

Scenario (engine start t0 = 100.0; request: prompt tokens, arrival, admissions, token times, end):
  a: 5 tokens, arrives 100.0,  scheduled 100.5,          tokens 101.0 101.25 101.5, stop at 101.5
  b: 3 tokens, arrives 100.25, scheduled 101.0, 101.75,  tokens 101.25 102.0, preempted once,
     length at 102.0
  c: 4 tokens, arrives 100.5,  never scheduled, aborted outside a step at 101.75
  d: 2 tokens, arrives 101.0,  scheduled 101.25,         token 101.5, stop at 101.5
Steps: 0 -> a's first token; 1 -> a, b; 2 -> a (done), d (done), b preempted; abort c;
       3 -> b recomputes and finishes.
"""

from __future__ import annotations

import math

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minserve.engine.request import Request, RequestStatus
from minserve.engine.stats import StepStats
from minserve.metrics import EngineMetrics, requests_frame, steps_frame
from minserve.sampling_params import SamplingParams

T0 = 100.0
MODEL = "test-model"


def make_request(rid: str, n_prompt: int, arrival: float) -> Request:
    return Request(rid, None, list(range(10, 10 + n_prompt)), SamplingParams(), arrival, 16, [2])


def step_stats(i, prefill, decode, running, waiting, kv, preempt=0, queries=0, hits=0):
    return StepStats(step=i, start_s=0.5 + 0.25 * i, step_time_s=0.25,
                     num_prefill_tokens=prefill, num_decode_tokens=decode,
                     num_running=running, num_waiting=waiting, kv_cache_usage=kv,
                     num_preemptions=preempt, prefix_cache_queries=queries,
                     prefix_cache_hits=hits)


def sample(req: Request, t: float) -> tuple[Request, int]:
    """One new token for ``req`` at ``t``, as the engine reports it: (request, new tokens)."""
    req.timeline.token_s.append(t)
    req.output_token_ids.append(100 + len(req.output_token_ids))
    return req, 1


def finish(req: Request, status: RequestStatus, t: float) -> Request:
    req.status = status
    req.timeline.finished_s = t
    return req


def run_scenario(metrics: EngineMetrics):
    a, b, c, d = (make_request("a", 5, 100.0), make_request("b", 3, 100.25),
                  make_request("c", 4, 100.5), make_request("d", 2, 101.0))
    a.timeline.scheduled_s.append(100.5)
    metrics.record_step(step_stats(0, 5, 0, 1, 3, 0.25, queries=5), [sample(a, 101.0)], [])
    b.timeline.scheduled_s.append(101.0)
    metrics.record_step(step_stats(1, 3, 1, 2, 2, 0.5, queries=3),
                        [sample(a, 101.25), sample(b, 101.25)], [])
    d.timeline.scheduled_s.append(101.25)
    b.num_preemptions = 1
    b.timeline.preempted_s.append(101.5)
    sampled = [sample(a, 101.5), sample(d, 101.5)]
    done = [finish(a, RequestStatus.FINISHED_STOPPED, 101.5),
            finish(d, RequestStatus.FINISHED_STOPPED, 101.5)]
    metrics.record_step(step_stats(2, 2, 1, 0, 2, 0.75, preempt=1, queries=2, hits=1), sampled, done)
    metrics.record_abort(finish(c, RequestStatus.FINISHED_ABORTED, 101.75))
    b.timeline.scheduled_s.append(101.75)
    metrics.record_step(step_stats(3, 4, 0, 0, 0, 0.125, queries=4, hits=2),
                        [sample(b, 102.0)], [finish(b, RequestStatus.FINISHED_LENGTH, 102.0)])
    return a, b, c, d


@pytest.fixture
def scenario():
    m = EngineMetrics(MODEL)
    reqs = run_scenario(m)
    return m, reqs


def test_counters_and_gauges(scenario):
    m, _ = scenario
    s = m.snapshot()
    assert s["vllm:prompt_tokens"] == 5 + 3 + 2          # c never got a token: not counted
    assert s["vllm:generation_tokens"] == 6
    assert s["vllm:num_preemptions"] == 1
    assert s["vllm:prefix_cache_queries"] == 14
    assert s["vllm:prefix_cache_hits"] == 3
    assert s['vllm:request_success{finished_reason="stop"}'] == 2
    assert s['vllm:request_success{finished_reason="length"}'] == 1
    assert s['vllm:request_success{finished_reason="abort"}'] == 1
    assert s['vllm:request_success{finished_reason="error"}'] == 0
    assert s["vllm:request_success"] == 4
    # gauges hold the last step's values
    assert s["vllm:num_requests_running"] == 0
    assert s["vllm:num_requests_waiting"] == 0
    assert s["vllm:kv_cache_usage_perc"] == 0.125


def test_latency_histograms(scenario):
    m, reqs = scenario
    s = m.snapshot()

    def hist(name):
        return s[f"vllm:{name}_count"], s[f"vllm:{name}_sum"]

    assert hist("time_to_first_token_seconds") == (3, 1.0 + 1.0 + 0.5)
    total_tokens = sum(len(r.output_token_ids) for r in reqs)
    with_tokens = sum(1 for r in reqs if r.output_token_ids)
    assert hist("inter_token_latency_seconds") == (total_tokens - with_tokens, 0.25 + 0.25 + 0.75)
    # TPOT only for requests with >= 2 tokens (a, b): (last - first) / (n - 1)
    assert hist("request_time_per_output_token_seconds") == (2, 0.25 + 0.75)
    assert hist("e2e_request_latency_seconds") == (4, 1.5 + 1.75 + 0.5 + 1.25)
    assert hist("request_queue_time_seconds") == (3, 0.5 + 0.75 + 0.25)   # c never scheduled
    assert hist("request_prefill_time_seconds") == (3, 0.5 + 0.25 + 0.25)
    assert hist("request_decode_time_seconds") == (3, 0.5 + 0.75 + 0.0)
    assert hist("request_prompt_tokens") == (4, 5 + 3 + 4 + 2)
    assert hist("request_generation_tokens") == (4, 3 + 2 + 0 + 1)
    assert hist("iteration_tokens_total") == (4, 5 + 4 + 3 + 4)


def test_exposition_uses_vllm_names(scenario):
    m, _ = scenario
    text = m.exposition().decode()
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:iteration_tokens_total_bucket", "vllm:inter_token_latency_seconds_count",
                 "vllm:request_time_per_output_token_seconds_sum"):
        assert name in text, name
    assert f'model_name="{MODEL}"' in text
    assert "# TYPE vllm:prompt_tokens_total counter" in text   # as in vLLM's /metrics
    assert "vllm:prompt_tokens_total_total" not in text
    # Parse it back as a scraper would: the TTFT buckets are cumulative at vLLM's boundaries.
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    buckets = {s.labels["le"]: s.value for s in fams["vllm:time_to_first_token_seconds"].samples
               if s.name.endswith("_bucket")}
    assert buckets["0.25"] == 0 and buckets["0.5"] == 1 and buckets["1.0"] == 3
    assert buckets["+Inf"] == 3 and len(buckets) == 23   # 22 boundaries + Inf, like vLLM
    success = {s.labels["finished_reason"]: s.value for s in fams["vllm:request_success"].samples
               if s.name.endswith("_total")}
    assert success == {"stop": 2, "length": 1, "abort": 1, "error": 0}


def test_two_engines_do_not_collide():
    m1, m2 = EngineMetrics("same"), EngineMetrics("same")   # same names would clash in one registry
    run_scenario(m1)
    assert m1.snapshot()["vllm:generation_tokens"] == 6
    assert m2.snapshot()["vllm:generation_tokens"] == 0
    assert m2.snapshot()["vllm:time_to_first_token_seconds_count"] == 0
    # nothing leaked into prometheus_client's process-wide default registry
    assert prometheus_client.REGISTRY.get_sample_value(
        "vllm:generation_tokens_total", {"model_name": "same"}) is None


def test_disabled_records_nothing():
    m = EngineMetrics(MODEL, enabled=False)
    run_scenario(m)   # must not raise
    assert m.snapshot() == {}
    assert b"vllm:" not in m.exposition()


def test_requests_frame_matches_timelines(scenario):
    pytest.importorskip("pandas")   # an optional extra (the lab); the metrics above need only prometheus
    _, (a, b, c, d) = scenario
    a.num_cached_tokens = 2   # the engine may record prefix-cache hits per request
    df = requests_frame([a, b, c, d], T0).set_index("request_id")
    assert list(df.loc["a", ["status", "finish_reason"]]) == ["stop", "stop"]
    assert df.loc["b", "finish_reason"] == "length" and df.loc["c", "status"] == "abort"
    assert df.prompt_tokens.to_dict() == {"a": 5, "b": 3, "c": 4, "d": 2}
    assert df.output_tokens.to_dict() == {"a": 3, "b": 2, "c": 0, "d": 1}
    assert df.cached_tokens.to_dict() == {"a": 2, "b": 0, "c": 0, "d": 0}
    assert df.num_preemptions.to_dict() == {"a": 0, "b": 1, "c": 0, "d": 0}
    ra = df.loc["a"]
    assert (ra.arrival_s, ra.first_scheduled_s, ra.first_token_s, ra.finished_s) == (0.0, 0.5, 1.0, 1.5)
    assert (ra.queue_s, ra.ttft_s, ra.prefill_s, ra.decode_s, ra.e2e_s) == (0.5, 1.0, 0.5, 0.5, 1.5)
    assert (ra.tpot_s, ra.itl_mean_s, ra.itl_max_s) == (0.25, 0.25, 0.25)
    assert ra.token_times_s == [1.0, 1.25, 1.5]
    rb = df.loc["b"]
    assert (rb.queue_s, rb.ttft_s, rb.prefill_s, rb.e2e_s, rb.itl_max_s) == (0.75, 1.0, 0.25, 1.75, 0.75)
    rc = df.loc["c"]   # aborted before scheduling: only arrival, finish and e2e are defined
    assert rc.e2e_s == 1.25 and rc.token_times_s == []
    for col in ("first_scheduled_s", "first_token_s", "queue_s", "ttft_s", "prefill_s",
                "decode_s", "tpot_s", "itl_mean_s", "itl_max_s"):
        assert math.isnan(rc[col]), col
    rd = df.loc["d"]   # one token: no gaps, no TPOT
    assert rd.ttft_s == 0.5 and rd.decode_s == 0.0
    assert math.isnan(rd.tpot_s) and math.isnan(rd.itl_mean_s)
    # The frame and the histograms agree.
    s = EngineMetrics(MODEL)
    run_scenario(s)
    snap = s.snapshot()
    assert df.ttft_s.sum() == snap["vllm:time_to_first_token_seconds_sum"]
    assert df.e2e_s.sum() == snap["vllm:e2e_request_latency_seconds_sum"]
    assert df.tpot_s.sum() == snap["vllm:request_time_per_output_token_seconds_sum"]


def test_requests_frame_unfinished_and_empty():
    pd = pytest.importorskip("pandas")
    r = make_request("w", 3, 100.25)
    df = requests_frame([r], T0)
    assert df.loc[0, "status"] == "waiting" and pd.isna(df.loc[0, "finish_reason"])
    assert df.loc[0, "arrival_s"] == 0.25 and math.isnan(df.loc[0, "e2e_s"])
    empty = requests_frame([], T0)
    assert len(empty) == 0 and "ttft_s" in empty.columns and "token_times_s" in empty.columns


def test_steps_frame():
    pytest.importorskip("pandas")
    steps = [step_stats(0, 5, 0, 1, 3, 0.25, queries=5), step_stats(1, 3, 1, 2, 2, 0.5)]
    df = steps_frame(steps)
    for col in ("step", "start_s", "step_time_s", "num_prefill_tokens", "num_decode_tokens",
                "num_running", "num_waiting", "kv_cache_usage", "num_preemptions",
                "prefix_cache_queries", "prefix_cache_hits", "end_s", "tokens"):
        assert col in df.columns, col
    assert df.tokens.tolist() == [5, 4]
    assert df.end_s.tolist() == [0.75, 1.0]
    assert df.kv_cache_usage.tolist() == [0.25, 0.5]


def test_steps_frame_from_real_stepstats():
    pytest.importorskip("pandas")
    from minserve.engine.llm_engine import StepStats
    fields = {f: 0 for f in StepStats.__dataclass_fields__}
    fields.update(start_s=1.0, step_time_s=0.5, num_prefill_tokens=7, num_decode_tokens=2)
    df = steps_frame([StepStats(**fields)])
    assert list(df.columns[:len(fields)]) == list(StepStats.__dataclass_fields__)
    assert df.loc[0, "end_s"] == 1.5 and df.loc[0, "tokens"] == 9
    empty = steps_frame([])
    assert len(empty) == 0 and {"end_s", "tokens", "kv_cache_usage"} <= set(empty.columns)
