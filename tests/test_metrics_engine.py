"""Engine metrics agree with the request timelines and the DataFrames a notebook reads."""

import math

from minserve import LLM, SamplingParams
from prompts import mixed_prompts


def _workload():
    llm = LLM("tiny-llama", num_kv_blocks=24, max_num_seqs=8, max_num_batched_tokens=64)
    eng = llm.llm_engine
    system = list(range(9000, 9032))
    prompts = [system + p for p in mixed_prompts(llm.get_tokenizer(), 10, 4, 80, seed=9)]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=10 + 3 * i, ignore_eos=True))
    eng.add_request("stopper", prompts[0], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[]))
    for _ in range(6):
        eng.step()
    eng.abort_request("r9")
    while eng.has_unfinished_requests():
        eng.step()
    return llm


def test_counters_match_timelines_and_frames():
    llm = _workload()
    eng = llm.llm_engine
    snap = eng.snapshot()
    req = eng.requests_frame()
    steps = eng.steps_frame()
    assert len(req) == 11 and set(req.request_id) >= {"r0", "r9", "stopper"}
    assert snap["vllm:generation_tokens"] == req.output_tokens.sum()
    got_tokens = req[req.output_tokens > 0]
    assert snap["vllm:prompt_tokens"] == got_tokens.prompt_tokens.sum()
    reasons = req.finish_reason.value_counts().to_dict()
    for reason, n in reasons.items():
        assert snap[f'vllm:request_success{{finished_reason="{reason}"}}'] == n
    assert reasons["abort"] == 1
    assert snap["vllm:num_preemptions"] == steps.num_preemptions.sum() == req.num_preemptions.sum() > 0
    assert snap["vllm:prefix_cache_hits"] == steps.prefix_cache_hits.sum() > 0
    assert snap["vllm:prefix_cache_queries"] == steps.prefix_cache_queries.sum()
    assert snap["vllm:iteration_tokens_total_count"] == len(steps)
    assert snap["vllm:iteration_tokens_total_sum"] == steps.tokens.sum()
    assert snap["vllm:time_to_first_token_seconds_count"] == len(got_tokens)
    assert math.isclose(snap["vllm:time_to_first_token_seconds_sum"], got_tokens.ttft_s.sum(), rel_tol=1e-9)
    assert math.isclose(snap["vllm:e2e_request_latency_seconds_sum"], req.e2e_s.sum(), rel_tol=1e-9)
    itl_count = (got_tokens.output_tokens - 1).sum()
    assert snap["vllm:inter_token_latency_seconds_count"] == itl_count
    assert snap["vllm:num_requests_running"] == 0 and snap["vllm:num_requests_waiting"] == 0
    assert snap["vllm:kv_cache_usage_perc"] == 0.0
    # TTFT >= queue time, and the frame's phases add up
    done = req[req.finish_reason == "length"]
    assert (done.ttft_s >= done.queue_s).all()
    assert ((done.queue_s + done.prefill_s + done.decode_s - (done.e2e_s)).abs() < 0.05).all()


def test_exposition_uses_vllm_names_and_engines_do_not_collide():
    a = LLM("tiny-llama", num_kv_blocks=16)
    b = LLM("tiny-llama", num_kv_blocks=16)
    a.generate("hello", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    text_a = a.llm_engine.metrics.exposition().decode()
    text_b = b.llm_engine.metrics.exposition().decode()
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:request_success_total", "vllm:iteration_tokens_total_bucket"):
        assert name in text_a
    assert 'model_name="tiny-llama"' in text_a
    assert 'vllm:generation_tokens_total{model_name="tiny-llama"} 3.0' in text_a
    assert 'vllm:generation_tokens_total{model_name="tiny-llama"} 0.0' in text_b


def test_disable_log_stats_keeps_timelines():
    llm = LLM("tiny-llama", num_kv_blocks=16, disable_log_stats=True)
    llm.generate("hello", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert llm.llm_engine.snapshot() == {}
    assert len(llm.llm_engine.requests_frame()) == 1 and len(llm.llm_engine.steps_frame()) >= 3


def test_abort_refreshes_gauges_at_once(tiny_llm):
    eng = tiny_llm.llm_engine
    eng.add_request("g", list(range(300, 340)), SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    assert eng.snapshot()["vllm:num_requests_running"] == 1
    eng.abort_request("g")
    snap = eng.snapshot()
    assert snap["vllm:num_requests_running"] == 0 and snap["vllm:kv_cache_usage_perc"] == 0.0


def test_out_of_vocabulary_stop_token_is_rejected(tiny_llm):
    import pytest
    with pytest.raises(ValueError, match=r"stop_token_ids must be in \[0, 49152\)"):
        tiny_llm.llm_engine.add_request("bad-stop", "hi", SamplingParams(stop_token_ids=[10**6], min_tokens=2))
