"""The OpenAI-compatible server, live: uvicorn on a free port, the official ``openai`` client,
raw httpx for streams, overload bursts and disconnects. One small server for the module."""

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from minserve import SamplingParams
from minserve.engine.llm_engine import LLMEngine
from live_server import live_server
from minserve.server import AdmissionConfig, ClassLimits, create_app

MAX_NUM_SEQS, MAX_QUEUED = 2, 4
PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine.from_engine_args("tiny-llama", max_num_seqs=MAX_NUM_SEQS,
                                        max_num_batched_tokens=128, num_kv_blocks=64)
    limits = ClassLimits(max_queued_requests=MAX_QUEUED)
    app = create_app(engine, admission=AdmissionConfig(interactive=limits, batch=limits))
    with live_server(app) as base:
        yield SimpleNamespace(base=base, engine=engine, app=app, st=app.state.minserve,
                              client=openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0))


def wait_idle(srv, timeout_s=20.0):
    """Until the engine holds no request and every KV block is back in the pool."""
    eng, pool = srv.engine, srv.engine.kv.pool
    deadline = time.monotonic() + timeout_s
    while eng.has_unfinished_requests() or pool.num_free != pool.num_blocks:
        assert time.monotonic() < deadline, f"{pool.num_blocks - pool.num_free} blocks still held"
        time.sleep(0.02)


def metric(srv, name: str) -> float:
    text = httpx.get(f"{srv.base}/metrics").text
    for line in text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def sse_events(lines) -> list:
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_models_health_metrics(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]
    assert httpx.get(f"{server.base}/health").status_code == 200
    text = httpx.get(f"{server.base}/metrics").text
    assert "vllm:kv_cache_usage_perc" in text and "minserve:admission_rejected_total" in text


def test_completion_matches_engine_greedy_and_stream_concatenates(server, tiny_llm):
    ref = tiny_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    out = server.client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=8,
                                           temperature=0)
    assert out.choices[0].text == ref.outputs[0].text
    assert out.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (
        len(ref.prompt_token_ids), len(ref.outputs[0].token_ids))
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens

    chunks = list(server.client.completions.create(
        model="tiny-llama", prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.outputs[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [ref.outputs[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_prompt_as_token_ids(server, tiny_llm):
    ids = tiny_llm.get_tokenizer()(PROMPT).input_ids
    a = server.client.completions.create(model="tiny-llama", prompt=ids, max_tokens=4, temperature=0)
    b = server.client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=4, temperature=0)
    assert a.choices[0].text == b.choices[0].text and a.usage == b.usage


def test_chat_matches_engine_greedy_and_stream(server, tiny_llm):
    ref = tiny_llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    out = server.client.chat.completions.create(model="tiny-llama", messages=CHAT,
                                                max_completion_tokens=6, temperature=0)
    msg = out.choices[0].message
    assert (msg.role, msg.content) == ("assistant", ref.outputs[0].text)
    assert out.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)

    chunks = list(server.client.chat.completions.create(
        model="tiny-llama", messages=CHAT, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_logprobs(server):
    out = server.client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=3,
                                           temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(len(t) <= 2 for t in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    chat = server.client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=3,
                                                 temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    # Greedy: the sampled token is the most likely one.
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT * 400}, 400, "prompt"),
    ("/v1/completions", {"prompt": [PROMPT, ""]}, 400, "prompt.1"),  # a batch names its bad prompt
    ("/v1/completions", {"prompt": PROMPT, "model": "gpt-9"}, 404, "model"),
    ("/v1/completions", {"prompt": PROMPT, "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -1}, 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 3}, 400, "top_logprobs"),
])
def test_bad_input_is_a_clear_4xx(server, path, body, status, param):
    r = httpx.post(server.base + path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and param in err["message"]


def test_malformed_json_is_400(server):
    r = httpx.post(server.base + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.1"  # where parsing stopped


def test_openai_client_sees_typed_errors(server):
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model="tiny-llama", prompt=PROMPT, top_p=1.5)
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="nope", prompt=PROMPT)


def test_deadline_that_cannot_be_met_is_shed_before_work(server):
    r = httpx.post(server.base + "/v1/completions", headers={"x-deadline-ms": "0.01"},
                   json={"prompt": PROMPT, "max_tokens": 8})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "deadline"


async def _burst(base: str, n: int) -> list:
    limits = httpx.Limits(max_connections=n + 2)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as c:
        async def one(i: int):
            body = {"prompt": f"{PROMPT} {i}", "max_tokens": 24, "ignore_eos": True,
                    "temperature": 0, "stream": i % 2 == 0}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                lines = [line async for line in r.aiter_lines()]
                return r.status_code, r.headers, lines
        return await asyncio.gather(*(one(i) for i in range(n)))


def test_overload_burst_sheds_explicitly_and_leaves_nothing_behind(server):
    n = 3 * (MAX_NUM_SEQS + MAX_QUEUED)
    results = asyncio.run(_burst(server.base, n))
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 429, 503}, statuses
    assert statuses.count(429) >= 1 and statuses.count(200) >= 1
    for status, headers, lines in results:
        if status == 429:
            assert int(headers["retry-after"]) >= 1
            continue
        if headers["content-type"].startswith("text/event-stream"):
            events = sse_events(lines)
            assert events[-1] == "[DONE]"
            assert [e["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "length"
        else:
            body = json.loads("".join(lines))
            assert body["choices"][0]["finish_reason"] == "length"
            assert body["usage"]["completion_tokens"] == 24
    wait_idle(server)
    assert httpx.get(f"{server.base}/health").status_code == 200
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert metric(server, name) == 0
    shed = server.st.admission
    assert shed.queued("interactive") == (0, 0) and shed.inflight("anonymous") == 0
    text = httpx.get(f"{server.base}/metrics").text
    rejected = [line for line in text.splitlines() if line.startswith(
        'minserve:admission_rejected_total{priority_class="interactive",reason="queue_full_requests"}')]
    assert float(rejected[0].rsplit(" ", 1)[1]) >= statuses.count(429)


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server):
    key = 'vllm:request_success{finished_reason="abort"}'
    before = server.engine.metrics.snapshot()[key]
    body = {"prompt": PROMPT, "max_tokens": 600, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    break  # leaving the block closes the connection mid-stream
    wait_idle(server, timeout_s=10)
    assert server.engine.metrics.snapshot()[key] == before + 1
    assert server.st.admission.inflight("anonymous") == 0


def test_engine_step_failure_fails_only_that_request(server):
    runner = server.engine.runner
    real = runner.execute

    def broken_once(*args, **kwargs):
        runner.execute = real
        raise RuntimeError("injected kernel failure")

    runner.execute = broken_once
    r = httpx.post(server.base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=30)
    assert r.status_code == 500 and "injected kernel failure" in r.json()["error"]["message"]
    runner.execute = broken_once
    with httpx.stream("POST", server.base + "/v1/completions", timeout=30,
                      json={"prompt": PROMPT, "max_tokens": 4, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    assert "injected" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
    # The engine goes on serving.
    ok = server.client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2)
    assert ok.usage.completion_tokens == 2
    wait_idle(server)
    assert httpx.get(f"{server.base}/health").status_code == 200


def test_draining_answers_503_and_health_says_so(server):
    adm = server.st.admission
    adm.begin_drain()
    try:
        assert httpx.get(f"{server.base}/health").status_code == 503
        r = httpx.post(server.base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        assert "retry-after" in r.headers
    finally:
        adm.draining = False  # this module's server lives on for other tests


def test_priority_class_header_and_field_reach_admission(server):
    reg = server.engine.metrics.registry
    key = "minserve:admission_admitted_total"
    before = reg.get_sample_value(key, {"priority_class": "batch"})
    r1 = httpx.post(server.base + "/v1/completions", headers={"x-priority-class": "batch"},
                    json={"prompt": PROMPT, "max_tokens": 1})
    r2 = httpx.post(server.base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "priority": 3})
    assert r1.status_code == r2.status_code == 200
    assert reg.get_sample_value(key, {"priority_class": "batch"}) == before + 2
    r = httpx.post(server.base + "/v1/completions", headers={"x-priority-class": "vip"},
                   json={"prompt": PROMPT, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-priority-class"


def test_cli_serves_and_drains_on_sigterm():
    """`minserve serve` end to end: flags reach the engine, SIGTERM drains, the process exits 0."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    cmd = [sys.executable, "-m", "minserve.cli", "serve", "--model", "tiny-llama", "--port", str(port),
           "--num-kv-blocks", "32", "--max-num-seqs", "2", "--max-model-len", "256",
           "--served-model-name", "tiny", "--log-level", "warning", "--drain-timeout", "10"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        card = httpx.get(f"{base}/v1/models").json()["data"][0]
        assert (card["id"], card["max_model_len"]) == ("tiny", 256)
        r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
