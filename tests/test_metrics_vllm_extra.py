"""The vLLM series a dashboard expects beyond the latencies: vllm:cache_config_info,
vllm:request_params_n / _max_tokens, vllm:request_inference_time_seconds and the process
collectors, scraped from a live server's /metrics."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from live_server import served
from minserve import LLM, SamplingParams
from minserve.engine.llm_engine import LLMEngine

NUM_BLOCKS, BLOCK_SIZE = 64, 16


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine.from_engine_args("tiny-llama", max_num_seqs=4, max_num_batched_tokens=128,
                                        num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    with served(engine) as srv:
        yield srv


def scrape(server) -> dict:
    """{sample name: [(labels, value), ...]} of /metrics."""
    out: dict = {}
    for family in text_string_to_metric_families(httpx.get(server.base + "/metrics").text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples: dict, name: str) -> float:
    (_, v), = samples[name]
    return v


def test_cache_config_info_describes_the_kv_cache(server):
    (labels, v), = scrape(server)["vllm:cache_config_info"]
    assert v == 1.0
    assert labels["block_size"] == str(BLOCK_SIZE) and labels["num_gpu_blocks"] == str(NUM_BLOCKS)
    assert labels["num_gpu_blocks_override"] == str(NUM_BLOCKS)  # num_kv_blocks was given
    assert labels["enable_prefix_caching"] == "True" and labels["cache_dtype"] == "auto"
    assert labels["engine"] == "0" and labels["num_cpu_blocks"] == "None"


def test_request_params_and_inference_time_per_finished_request(server):
    before = scrape(server)
    for max_tokens in (3, 7):
        r = httpx.post(server.base + "/v1/completions", timeout=60,
                       json={"prompt": "Count with me", "max_tokens": max_tokens, "ignore_eos": True})
        assert r.status_code == 200
    after = scrape(server)

    def grew(name: str) -> float:
        return value(after, name) - value(before, name)

    assert grew("vllm:request_params_max_tokens_count") == 2
    assert grew("vllm:request_params_max_tokens_sum") == 3 + 7
    assert grew("vllm:request_params_n_count") == 2 and grew("vllm:request_params_n_sum") == 2
    assert grew("vllm:request_inference_time_seconds_count") == 2
    # Inference time is the request's time in the running set: its prefill plus its decode.
    inference = grew("vllm:request_inference_time_seconds_sum")
    phases = grew("vllm:request_prefill_time_seconds_sum") + grew("vllm:request_decode_time_seconds_sum")
    assert inference > 0 and inference == pytest.approx(phases, abs=1e-6)
    assert inference <= grew("vllm:e2e_request_latency_seconds_sum")
    # vLLM's buckets: n in 1, 2, 5, 10, 20; max_tokens 1, 2, 5, 10, 20, 50, ...
    buckets = {labels["le"]: v for labels, v in after["vllm:request_params_max_tokens_bucket"]}
    assert buckets["5.0"] - dict((lb["le"], v) for lb, v in before["vllm:request_params_max_tokens_bucket"])["5.0"] == 1
    assert [lb["le"] for lb, _ in after["vllm:request_params_n_bucket"]] == ["1.0", "2.0", "5.0", "10.0", "20.0", "+Inf"]


def test_request_params_n_counts_a_request_once_with_its_n(server):
    before = scrape(server)
    r = httpx.post(server.base + "/v1/completions", timeout=60,
                   json={"prompt": "Three ways", "n": 3, "max_tokens": 4, "seed": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    after = scrape(server)
    assert value(after, "vllm:request_params_n_count") - value(before, "vllm:request_params_n_count") == 1
    assert value(after, "vllm:request_params_n_sum") - value(before, "vllm:request_params_n_sum") == 3


def test_process_collectors_are_served(server):
    samples = scrape(server)
    assert value(samples, "process_resident_memory_bytes") > 10 * 2**20
    assert value(samples, "process_cpu_seconds_total") > 0
    assert value(samples, "process_open_fds") > 0 and value(samples, "process_start_time_seconds") > 0
    (labels, _), = samples["python_info"]
    assert labels["implementation"] == "CPython"
    assert any(name.startswith("python_gc_") for name in samples)


def test_a_second_engine_in_one_process_gets_them_too():
    """The process collectors are shared: registering them in every engine's registry must not
    clash (the labs build several engines in one notebook)."""
    a = LLM("tiny-llama", num_kv_blocks=16)
    b = LLM("tiny-llama", num_kv_blocks=32)
    a.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    for llm, blocks in ((a, 16), (b, 32)):
        text = llm.llm_engine.metrics.exposition().decode()
        assert "process_resident_memory_bytes" in text and f'num_gpu_blocks="{blocks}"' in text
    quiet = LLM("tiny-llama", num_kv_blocks=16, disable_log_stats=True)
    assert quiet.llm_engine.metrics.exposition() == b""
