"""minserve.bench: metric formulas, arrival process, workloads, in-process driver, HTTP client."""

import json
import math
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from minserve.bench.arrivals import arrival_times
from minserve.bench.client import SSEReader
from minserve.bench.metrics import RequestRecord, calculate_metrics, parse_goodput, result_dict
from minserve.bench.server_metrics import parse_metrics_text

VLLM_KEYS = ["date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate",
             "burstiness", "max_concurrency", "duration", "completed", "total_input_tokens",
             "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls",
             "generated_texts", "errors"]


# ---- metrics on a hand-made run ------------------------------------------------------------

def recorded_run():
    """Three successes and one failure, 2 s run; the expected values are worked out below."""
    return [
        RequestRecord("a", prompt_len=10, start_time=0.0, ttft=0.1, itl=[0.02, 0.03, 0.05],
                      latency=0.2, output_tokens=4, generated_text="abcd", success=True),
        RequestRecord("b", prompt_len=20, start_time=0.05, ttft=0.3, itl=[0.1], latency=0.5,
                      output_tokens=2, generated_text="ef", success=True),
        RequestRecord("c", prompt_len=5, start_time=0.1, ttft=0.2, latency=0.2, output_tokens=1,
                      generated_text="g", success=True),
        RequestRecord("d", prompt_len=7, start_time=0.1, error="boom"),
    ]


def test_metrics_match_hand_computed_values():
    m, lens = calculate_metrics(recorded_run(), 2.0, percentiles=[50, 99])
    approx = lambda x: pytest.approx(x, rel=1e-9, abs=1e-9)  # noqa: E731
    assert lens == [4, 2, 1, 0]
    assert (m.completed, m.failed, m.total_input, m.total_output) == (3, 1, 35, 7)
    assert m.request_throughput == approx(1.5) and m.output_throughput == approx(3.5)
    assert m.total_token_throughput == approx(21.0)
    # TTFT over successes [0.1, 0.3, 0.2] s; p99 by linear interpolation: 0.2 + 0.98 * 0.1.
    assert m.stats_ms["ttft"] == {"mean": approx(200), "median": approx(200),
                                  "std": approx(1000 * math.sqrt(0.02 / 3)), "p50": approx(200),
                                  "p99": approx(298)}
    # TPOT = (latency - ttft) / (n - 1): a -> 0.1/3, b -> 0.2, c has one token (no TPOT).
    assert m.stats_ms["tpot"]["mean"] == approx(1000 * (0.1 / 3 + 0.2) / 2)
    assert m.stats_ms["tpot"]["median"] == approx(1000 * (0.1 / 3 + 0.2) / 2)
    assert m.stats_ms["tpot"]["std"] == approx(1000 * (0.2 - 0.1 / 3) / 2)
    assert m.stats_ms["tpot"]["p99"] == approx(1000 * (0.1 / 3 + 0.99 * (0.2 - 0.1 / 3)))
    # ITL pools every gap: [0.02, 0.03, 0.05, 0.1].
    assert m.stats_ms["itl"] == {"mean": approx(50), "median": approx(40),
                                 "std": approx(1000 * math.sqrt(0.0038 / 4)), "p50": approx(40),
                                 "p99": approx(98.5)}
    assert m.stats_ms["e2el"] == {"mean": approx(300), "median": approx(200),
                                  "std": approx(1000 * math.sqrt(0.02)), "p50": approx(200),
                                  "p99": approx(494)}
    # Peak: every token lands in the first second, all three requests overlap there.
    assert (m.max_output_tokens_per_s, m.max_concurrent_requests) == (7.0, 3)


def test_goodput_counts_requests_meeting_every_slo_inclusive():
    recs = recorded_run()
    # a (ttft .1, tpot .033) and c (ttft .2, one token: tpot 0) meet both; b's ttft .3 does not.
    m, _ = calculate_metrics(recs, 2.0, goodput_ms=parse_goodput(["ttft:250", "tpot:100"]))
    assert m.request_goodput == pytest.approx(1.0)
    m, _ = calculate_metrics(recs, 2.0, goodput_ms={"e2el": 200.0})  # 0.2 s meets 200 ms
    assert m.request_goodput == pytest.approx(1.0)
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput(["latency:5"])
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput(["ttft=5"])


def test_output_len_falls_back_to_tokenizing_the_text():
    class WordTokenizer:
        def __call__(self, text, add_special_tokens=True):
            return type("Enc", (), {"input_ids": text.split()})()
    rec = RequestRecord(prompt_len=3, ttft=0.1, itl=[0.1], latency=0.3, output_tokens=0,
                        generated_text="one two three", success=True)
    m, lens = calculate_metrics([rec], 1.0, WordTokenizer())
    assert lens == [3] and m.stats_ms["tpot"]["mean"] == pytest.approx(100.0)
    _, lens = calculate_metrics([rec], 1.0, None)  # no tokenizer: one token per chunk
    assert lens == [2]


def test_result_dict_has_vllm_keys():
    recs = recorded_run()
    m, lens = calculate_metrics(recs, 2.0, percentiles=[99, 99.9])
    meta = {k: None for k in VLLM_KEYS[:8]}
    out = result_dict(recs, m, lens, 2.0, meta, ["ttft", "tpot", "itl", "e2el"], None)
    assert all(k in out for k in VLLM_KEYS)
    assert out["request_goodput"] is None and out["errors"][3] == "boom"
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99", "p99.9"):
            assert f"{stat}_{name}_ms" in out
    only_ttft = result_dict(recs, m, lens, 2.0, meta, ["ttft"], None)
    assert "mean_ttft_ms" in only_ttft and "mean_itl_ms" not in only_ttft
    with pytest.raises(ValueError, match="percentile_metrics"):
        result_dict(recs, m, lens, 2.0, meta, ["latency"], None)


# ---- arrival process -------------------------------------------------------------------------

def _cv(times):
    gaps = np.diff(np.concatenate([[0.0], times]))
    return gaps.std() / gaps.mean(), gaps.mean()


def test_poisson_arrivals_have_the_requested_mean_rate_and_unit_cv():
    t = arrival_times(4000, request_rate=10.0, burstiness=1.0, seed=1)
    cv, mean_gap = _cv(t)
    assert mean_gap == pytest.approx(0.1) and t[-1] == pytest.approx(400.0)
    assert np.all(np.diff(t) >= 0) and abs(cv - 1.0) < 0.08


def test_burstiness_changes_variance_not_rate():
    bursty, _ = _cv(arrival_times(4000, 10.0, burstiness=0.25, seed=1))
    smooth, mean_gap = _cv(arrival_times(4000, 10.0, burstiness=4.0, seed=1))
    # Gamma with shape k has CV 1/sqrt(k): 2 and 0.5.
    assert abs(bursty - 2.0) < 0.25 and abs(smooth - 0.5) < 0.05
    assert mean_gap == pytest.approx(0.1)
    assert np.allclose(np.diff(arrival_times(5, 2.0, burstiness=math.inf)), 0.5)


def test_infinite_rate_and_seeds():
    assert np.array_equal(arrival_times(5, math.inf), np.zeros(5))
    assert np.array_equal(arrival_times(50, 3.0, 1.0, seed=7), arrival_times(50, 3.0, 1.0, seed=7))
    assert not np.array_equal(arrival_times(50, 3.0, 1.0, seed=7), arrival_times(50, 3.0, 1.0, seed=8))
    with pytest.raises(ValueError, match="request_rate"):
        arrival_times(3, 0.0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(3, 1.0, burstiness=0)


# ---- workloads -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    from minserve.models.loader import load_tokenizer, resolve_model_dir
    return load_tokenizer(resolve_model_dir("tiny-llama"))


@pytest.fixture(scope="module")
def corpus(tokenizer):
    from minserve.bench.corpus import Corpus
    return Corpus(tokenizer)


@pytest.fixture()
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network access during a workload build")
    monkeypatch.setattr(socket.socket, "connect", refuse)


def test_scenarios_have_the_documented_lengths_offline(tokenizer, no_network):
    from minserve.bench.corpus import Corpus, render_module
    from minserve.bench.datasets import sample_scenario
    render_module.cache_clear()  # render the corpus again, now with the network refused
    corpus = Corpus(tokenizer)
    qa = sample_scenario(tokenizer, "qa", 200, seed=3, corpus=corpus)
    p, o = np.array([r.prompt_len for r in qa]), np.array([r.expected_output_len for r in qa])
    assert p.min() >= 40 - 3 and p.max() <= 192 + 3 and abs(np.median(p) / 64 - 1) < 0.15
    assert o.min() >= 8 and o.max() <= 160 and abs(np.median(o) / 48 - 1) < 0.2
    rag = sample_scenario(tokenizer, "rag", 12, seed=3, corpus=corpus)
    assert all(512 - 4 <= r.prompt_len <= 2048 + 4 for r in rag)
    code = sample_scenario(tokenizer, "code", 30, seed=3, corpus=corpus)
    assert all(128 <= r.expected_output_len <= 1024 and r.prompt_len <= 260 for r in code)
    assert np.median([r.expected_output_len for r in code]) > 250  # long outputs
    agent = sample_scenario(tokenizer, "agent", 8, seed=3, corpus=corpus)
    ids = [tokenizer(r.prompt).input_ids for r in agent]
    shared = len(os.path.commonprefix(ids))
    assert 1020 <= shared <= 1030  # the 1024 instruction tokens are identical in every request
    assert all(r.prompt_len - shared >= 60 for r in agent) and all(r.expected_output_len <= 96 for r in agent)


def test_mix_is_weighted_and_deterministic(tokenizer, corpus):
    from minserve.bench.datasets import sample_scenario
    mix = sample_scenario(tokenizer, "mix", 100, seed=5, length_scale=0.1, corpus=corpus)
    counts = {k: sum(r.scenario == k for r in mix) for k in ("qa", "rag", "code", "agent")}
    assert 28 <= counts["qa"] <= 52 and all(10 <= counts[k] <= 30 for k in ("rag", "code", "agent"))
    again = sample_scenario(tokenizer, "mix", 100, seed=5, length_scale=0.1, corpus=corpus)
    assert [r.prompt for r in again] == [r.prompt for r in mix]
    other = sample_scenario(tokenizer, "mix", 100, seed=6, length_scale=0.1, corpus=corpus)
    assert [r.prompt for r in other] != [r.prompt for r in mix]


def test_random_dataset_hits_exact_lengths_with_shared_prefix(tokenizer):
    from minserve.bench.datasets import get_samples
    reqs = get_samples("random", tokenizer, 5, seed=0, random_input_len=32, random_output_len=8)
    assert [r.prompt_len for r in reqs] == [32] * 5 and [r.expected_output_len for r in reqs] == [8] * 5
    reqs = get_samples("random", tokenizer, 20, seed=0, random_input_len=40, random_output_len=10,
                       random_range_ratio=0.5, random_prefix_len=16)
    assert all(16 + 20 <= r.prompt_len <= 16 + 60 for r in reqs)
    assert all(5 <= r.expected_output_len <= 15 for r in reqs)
    ids = [tokenizer(r.prompt).input_ids for r in reqs]
    assert len(os.path.commonprefix(ids)) >= 15
    with pytest.raises(ValueError, match="range_ratio"):
        get_samples("random", tokenizer, 2, random_range_ratio=1.0)


def test_sharegpt_takes_first_human_turn_and_gpt_reply_length(tokenizer, tmp_path):
    from minserve.bench.datasets import get_samples
    data = [
        {"conversations": [{"from": "human", "value": "How do I reverse a list in Python quickly?"},
                           {"from": "gpt", "value": "Use slicing with a negative step: items[::-1]."}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]},
        {"conversations": [{"from": "human", "value": "only one turn here"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = get_samples("sharegpt", tokenizer, 3, seed=0, dataset_path=str(path))
    assert len(reqs) == 3 and {r.prompt for r in reqs} == {data[0]["conversations"][0]["value"]}
    reply = data[0]["conversations"][1]["value"]
    assert reqs[0].expected_output_len == len(tokenizer(reply, add_special_tokens=False).input_ids)
    assert [r.request_id for r in reqs] == ["0", "1", "2"]
    with pytest.raises(ValueError, match="dataset-path"):
        get_samples("sharegpt", tokenizer, 3)


# ---- in-process backend ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine():
    from minserve.engine.llm_engine import LLMEngine
    return LLMEngine.from_engine_args("tiny-llama", max_num_seqs=8, max_num_batched_tokens=256,
                                      num_kv_blocks=128)


def test_inprocess_run_completes_with_consistent_frames(engine, corpus):
    from minserve.bench import run_inprocess
    from minserve.bench.datasets import sample_scenario
    reqs = sample_scenario(engine.tokenizer, "mix", 6, seed=0, length_scale=0.1, corpus=corpus)
    res = run_inprocess(engine, reqs, request_rate=50.0, seed=0, max_concurrency=2,
                        ignore_eos=True, goodput={"ttft": 60_000})
    df, s = res.requests, res.summary
    assert s["completed"] == 6 and s["failed"] == 0 and s["request_goodput"] > 0
    assert len(df) == 6 and df.success.all()
    assert list(df.output_len) == [r.expected_output_len for r in reqs]  # ignore_eos
    assert list(df.prompt_len) == [len(engine.tokenizer(r.prompt).input_ids) for r in reqs]
    assert (df.itl_s.map(len) == df.output_len - 1).all()
    assert (df.ttft_s > 0).all() and (df.e2el_s >= df.ttft_s).all()
    multi = df[df.output_len > 1]
    assert np.allclose(multi.tpot_s, (multi.e2el_s - multi.ttft_s) / (multi.output_len - 1))
    assert (df.send_s >= df.scheduled_s - 1e-6).all()
    # Never more than max_concurrency requests in flight.
    events = sorted([(t, 1) for t in df.send_s] + [(t, -1) for t in df.finish_s])
    assert max(np.cumsum([d for _, d in events])) <= 2
    # Each request's first token comes from its prefill, every later one from a decode step.
    steps = res.steps
    assert int(steps.num_decode_tokens.sum()) + 6 == s["total_output_tokens"]
    assert int(steps.num_prefill_tokens.sum()) <= s["total_input_tokens"]
    assert steps.t_s.min() >= -1e-6 and steps.t_s.max() <= s["duration"]
    assert not engine.has_unfinished_requests()
    json.dumps(res.to_json())  # strict-JSON serializable


def test_inprocess_steps_follow_step_numbers_after_the_history_wrapped(corpus, caplog):
    """``engine.step_stats`` holds only the latest max_step_records steps; the run's steps are
    picked by their ``step`` number, so they stay right before and after the deque wraps."""
    from minserve.bench import run_inprocess
    from minserve.bench.datasets import SampleRequest
    from minserve.engine.llm_engine import LLMEngine
    eng = LLMEngine.from_engine_args("tiny-llama", num_kv_blocks=32, max_step_records=5)
    short = [SampleRequest("hello there", 2, 2, "a")]        # prefill + 1 decode: 2 steps
    for _ in range(3):                                        # fill the history (6 steps > 5)
        run_inprocess(eng, short, ignore_eos=True)
    before = eng.num_steps
    assert len(eng.step_stats) == 5 < before
    res = run_inprocess(eng, short, ignore_eos=True)
    assert res.steps.step.tolist() == list(range(before, eng.num_steps)) == [before, before + 1]
    assert res.steps.num_prefill_tokens[0] > 0 and res.steps.num_decode_tokens.tolist() == [0, 1]
    # A run longer than the history: its latest 5 steps, said so in the log, never older ones.
    before = eng.num_steps
    with caplog.at_level("WARNING", logger="minserve.bench.inprocess"):
        res = run_inprocess(eng, [SampleRequest("hello there", 2, 9, "b")], ignore_eos=True)
    assert eng.num_steps - before == 9
    assert res.steps.step.tolist() == list(range(eng.num_steps - 5, eng.num_steps))
    assert (res.steps.num_decode_tokens == 1).all() and (res.steps.t_s >= 0).all()
    assert "its first 4 are not in .steps" in caplog.text
    assert res.summary["completed"] == 1 and res.summary["output_lens"] == [9]


def test_inprocess_step_with_several_tokens_is_one_emission():
    """A step output with several new tokens (speculative decoding) is one emission: one ITL,
    no 0 s gaps, while TPOT divides by every token."""
    from types import SimpleNamespace

    from minserve.bench.datasets import SampleRequest
    from minserve.bench.inprocess import _Run
    from minserve.bench.results import BenchOptions, requests_frame

    class Engine:
        def add_request(self, *args):
            pass
    run = _Run(Engine(), [SampleRequest("p", 3, 6, "x")], BenchOptions())
    run.admit(0.0)
    rid, = run.in_flight
    run.records[0].start_time = 10.0

    def out(ids, t, finished=False):
        comp = SimpleNamespace(token_ids=ids, text="t" * len(ids),
                               finish_reason="length" if finished else None)
        run.collect([SimpleNamespace(request_id=rid, outputs=[comp], prompt_token_ids=[1, 2, 3],
                                     finished=finished)], t)
    out([5], 10.5)                 # prefill: the first token
    out([6, 7, 8], 11.0)           # three accepted at once
    out([], 11.125)                # a step that brought nothing: no emission
    out([9, 10], 11.25, finished=True)
    rec = run.records[0]
    assert rec.success and rec.output_tokens == 6
    assert (rec.ttft, rec.itl, rec.latency) == (0.5, [0.5, 0.25], 1.25)
    row = requests_frame([rec], [rec.output_tokens], 10.0).iloc[0]
    assert row.tpot_s == 0.75 / 5


# ---- HTTP client against a stub server -------------------------------------------------------

CHUNKS = ["Hello", " world", "", " again"]   # "" carries no text: not a token for TTFT/ITL
DELAY_S = 0.05
USAGE_TOKENS = 7                             # differs from the chunk count on purpose
METRICS_TEXT = """\
# HELP vllm:num_requests_running Number of requests in the running set.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="tiny-llama"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="tiny-llama"} 5.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="tiny-llama"} 0.25
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0"} 1.0
vllm:num_preemptions_total{engine="1"} 1.0
vllm:num_preemptions_created{engine="0"} 1.7e+09
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{model_name="tiny-llama"} 100.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{model_name="tiny-llama"} 40.0
"""


class StubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the body ends when the connection closes

    def log_message(self, *args):
        pass

    def _send(self, code, body, ctype="application/json"):
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.end_headers()
        self.wfile.write(body.encode())

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": "tiny-llama"}]}))
        elif self.path == "/metrics":
            self._send(200, METRICS_TEXT, "text/plain; version=0.0.4")
        else:
            self._send(404, '{"error": "not found"}')

    def _event(self, data):
        self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
        self.wfile.flush()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.payloads.append((self.path, body))
        chat = self.path == "/v1/chat/completions"
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            return self._send(404, '{"error": "no such endpoint"}')
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(b": keep-alive ping\r\n\r\n")
        if chat:
            self._event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        for text in CHUNKS:
            time.sleep(DELAY_S)
            self._event({"choices": [{"index": 0, "delta": {"content": text}} if chat
                                     else {"index": 0, "text": text}]})
        done = {"delta": {}} if chat else {"text": ""}
        self._event({"choices": [{"index": 0, **done, "finish_reason": "length"}]})
        if self.server.send_usage:
            self._event({"choices": [], "usage": {"prompt_tokens": 9,
                                                  "completion_tokens": USAGE_TOKENS}})
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture(scope="module")
def stub_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubHandler)
    server.daemon_threads = True
    server.payloads, server.send_usage = [], True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_sse_reader_and_metrics_parser():
    r = SSEReader()
    events = [r.feed(x) for x in [": ping", "", "data: {\"a\":", "data: 1}", "", "event: x",
                                  "data: [DONE]\r\n", "\r\n"]]
    assert [e for e in events if e is not None] == ['{"a":\n1}', "[DONE]"]
    values = parse_metrics_text(METRICS_TEXT)
    assert values == {"num_requests_running": 3.0, "num_requests_waiting": 5.0,
                      "kv_cache_usage_perc": 0.25, "num_preemptions_total": 2.0,
                      "prefix_cache_hits_total": 40.0, "prefix_cache_queries_total": 100.0}
    old = parse_metrics_text("# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.5\n")
    assert old["kv_cache_usage_perc"] == 0.5 and math.isnan(old["num_requests_running"])


def test_cli_sweep_against_stub_server(stub_server, tmp_path, capsys):
    from minserve.bench.cli import main
    url = f"http://127.0.0.1:{stub_server.server_address[1]}"
    stub_server.payloads.clear()
    rc = main(["--base-url", url, "--dataset-name", "random", "--random-input-len", "16",
               "--random-output-len", "5", "--num-prompts", "3", "--request-rate", "40,inf",
               "--save-result", "--result-dir", str(tmp_path), "--metrics-interval", "0.05",
               "--disable-tqdm",
               "--goodput", "ttft:10000", "--percentile-metrics", "ttft,tpot,itl,e2el"])
    assert rc == 0
    files = sorted(tmp_path.glob("openai-*qps-tiny-llama-*.json"))
    assert len(files) == 2 and "TTFT mean" in capsys.readouterr().out
    for f in files:
        res = json.loads(f.read_text())
        assert all(k in res for k in VLLM_KEYS) and res["completed"] == 3 and res["failed"] == 0
        assert res["output_lens"] == [USAGE_TOKENS] * 3 and res["input_lens"] == [16] * 3
        assert res["generated_texts"] == ["Hello world again"] * 3
        assert res["request_goodput"] == pytest.approx(res["request_throughput"])
        for ttft, itl in zip(res["ttfts"], res["itls"]):
            # Two gaps: the empty chunk is folded into the second one (two delays long). A chunk
            # cannot arrive before it was sent, so each arrival time (TTFT plus the gaps before
            # it) is at least its send time; one gap alone can be short when the client read the
            # chunk before it late (a busy machine: measured 8 ms for 50 ms).
            assert len(itl) == 2
            arrivals = [ttft, ttft + itl[0], ttft + itl[0] + itl[1]]
            assert all(a >= n * DELAY_S * 0.9 for a, n in zip(arrivals, (1, 2, 4))), arrivals
        for rec in res["requests"]:
            assert rec["success"] and rec["e2el_s"] >= rec["ttft_s"]
            assert rec["tpot_s"] == pytest.approx((rec["e2el_s"] - rec["ttft_s"]) / (USAGE_TOKENS - 1))
        series = res["server_metrics_timeseries"]
        assert len(series) >= 2 and series[0]["num_requests_running"] == 3.0
        assert series[-1]["num_preemptions_total"] == 2.0 and series[-1]["kv_cache_usage_perc"] == 0.25
    assert json.loads(files[0].read_text())["request_rate"] in (40.0, "inf")
    path, body = stub_server.payloads[0]
    assert path == "/v1/completions" and body["model"] == "tiny-llama" and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    assert body["temperature"] == 0 and body["max_tokens"] == 5 and isinstance(body["prompt"], str)


def test_chat_backend_without_usage_and_failed_requests(stub_server, tokenizer):
    import asyncio

    from minserve.bench.client import Target, run_http
    from minserve.bench.datasets import SampleRequest
    from minserve.bench.results import BenchOptions
    url = f"http://127.0.0.1:{stub_server.server_address[1]}"
    reqs = [SampleRequest("Say hello.", 4, 6, str(i)) for i in range(2)]
    stub_server.send_usage = False
    try:
        chat = Target(url + "/v1/chat/completions", url, "tiny-llama", chat=True)
        res = asyncio.run(run_http(chat, reqs, BenchOptions(max_concurrency=1), tokenizer, 0.05))
    finally:
        stub_server.send_usage = True
    n = len(tokenizer("Hello world again", add_special_tokens=False).input_ids)
    assert res.summary["completed"] == 2 and res.summary["output_lens"] == [n, n]
    assert all(len(itl) == 2 for itl in res.summary["itls"])  # the role-only chunk is no token
    path, body = stub_server.payloads[-1]
    assert body["messages"] == [{"role": "user", "content": "Say hello."}] and "ignore_eos" not in body
    assert body["max_completion_tokens"] == 6
    bad = Target(url + "/v1/nope", url, "tiny-llama")
    res = asyncio.run(run_http(bad, reqs, BenchOptions(), tokenizer, 0.05))
    assert res.summary["completed"] == 0 and res.summary["failed"] == 2
    assert all(e.startswith("HTTP 404") for e in res.summary["errors"])
    assert not res.requests.success.any()
