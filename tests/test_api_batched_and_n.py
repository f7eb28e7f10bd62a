"""Several choices in one response: a list of prompts in one completions request (one engine
request per prompt, as vLLM), ``n`` samples per prompt, streaming per choice index, usage summed,
``continuous_usage_stats``, and admission counting every prompt of a batch."""

import json
import time

import httpx
import pytest

from live_server import post_json as post
from live_server import served
from minserve import SamplingParams
from minserve.engine.llm_engine import LLMEngine
from minserve.server import AdmissionConfig, ClassLimits

MAX_QUEUED = 3
PROMPTS = ["The quick brown fox", "Once upon a time", "In the beginning"]


def n_supported() -> bool:
    try:
        SamplingParams(n=2)
        return True
    except ValueError:
        return False


needs_n = pytest.mark.skipif(not n_supported(), reason="parallel sampling (SamplingParams(n > 1)) "
                             "has not landed in the engine yet; the response side is ready")


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine.from_engine_args("tiny-llama", max_num_seqs=4, max_num_batched_tokens=128,
                                        num_kv_blocks=128)
    limits = ClassLimits(max_queued_requests=MAX_QUEUED)
    with served(engine, admission=AdmissionConfig(interactive=limits, batch=limits)) as srv:
        yield srv


def stream(server, path: str = "/v1/completions", **body) -> list[dict]:
    with httpx.stream("POST", server.base + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def texts_by_index(chunks: list[dict], key: str = "text") -> dict[int, str]:
    out: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            part = c[key] if key == "text" else c["delta"].get("content") or ""
            out[c["index"]] = out.get(c["index"], "") + part
    return out


def test_batch_of_prompts_equals_separate_requests(server):
    kw = dict(max_tokens=5, temperature=0, ignore_eos=True)
    singles = [post(server, prompt=p, **kw) for p in PROMPTS]
    batch = post(server, prompt=PROMPTS, **kw)
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    assert [c["text"] for c in batch["choices"]] == [s["choices"][0]["text"] for s in singles]
    assert all(c["finish_reason"] == "length" for c in batch["choices"])
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][key] == sum(s["usage"][key] for s in singles)
    ids = [server.tok(p).input_ids for p in PROMPTS]
    as_ids = post(server, prompt=ids, **kw)
    assert [c["text"] for c in as_ids["choices"]] == [c["text"] for c in batch["choices"]]


def test_batch_streams_every_prompt_with_continuous_usage(server):
    ids = [server.tok(p).input_ids for p in PROMPTS[:2]]
    kw = dict(prompt=ids, max_tokens=4, temperature=0, ignore_eos=True)
    whole = post(server, **kw)
    chunks = stream(server, stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw)
    *content, last = chunks
    assert texts_by_index(content) == {c["index"]: c["text"] for c in whole["choices"]}
    seen = {0: 0, 1: 0}
    for chunk in content:  # each chunk: usage of its own choice so far (vLLM's continuous usage)
        (c,) = chunk["choices"]
        u = chunk["usage"]
        assert u["prompt_tokens"] == len(ids[c["index"]])
        assert u["completion_tokens"] >= seen[c["index"]]
        seen[c["index"]] = u["completion_tokens"]
    assert seen == {0: 4, 1: 4}
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    plain = stream(server, stream_options={"include_usage": True}, **kw)
    assert all("usage" not in chunk for chunk in plain[:-1]) and plain[-1]["usage"] == whole["usage"]


def test_batch_is_admitted_whole_or_not_at_all(server):
    adm = server.st.admission
    too_many = [f"prompt number {i}" for i in range(MAX_QUEUED + 1)]
    err = post(server, status=429, prompt=too_many, max_tokens=2)["error"]
    assert err["code"] == "queue_full_requests"
    assert adm.queued("interactive") == (0, 0) and adm.inflight("anonymous") == 0
    assert not server.engine.has_unfinished_requests()  # nothing of the batch was submitted
    ok = post(server, prompt=too_many[:MAX_QUEUED], max_tokens=2)
    assert len(ok["choices"]) == MAX_QUEUED and adm.inflight("anonymous") == 0


def test_a_client_leaving_a_batch_stream_aborts_every_prompt(server):
    eng, pool = server.engine, server.engine.kv.pool
    aborted = 'vllm:request_success{finished_reason="abort"}'
    before = eng.snapshot().get(aborted, 0)
    body = {"prompt": PROMPTS[:2], "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith("data: {"))
    deadline = time.monotonic() + 30  # the server notices at its next write
    while eng.has_unfinished_requests() or pool.num_free != pool.num_blocks:
        assert time.monotonic() < deadline, "the batch was not aborted"
        time.sleep(0.05)
    assert eng.snapshot()[aborted] - before == 2
    assert server.st.admission.inflight("anonymous") == 0 and server.st.open_flights == 0


def test_a_failing_prompt_of_a_batch_is_a_clear_400(server):
    err = post(server, status=400, prompt=["fine", ""], max_tokens=2)["error"]
    assert err["param"] == "prompt.1"
    err = post(server, status=400, prompt=[[1, 2], [10**9]], max_tokens=2)["error"]
    assert err["param"] == "prompt.1"


@needs_n
def test_n_samples_are_choices_with_summed_usage_and_reproducible_streams(server):
    kw = dict(prompt=PROMPTS[0], n=3, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    whole = post(server, **kw)
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert whole["usage"]["completion_tokens"] == 3 * 6
    assert whole["usage"]["prompt_tokens"] == len(server.tok(PROMPTS[0]).input_ids)  # shared, once
    texts = [c["text"] for c in whole["choices"]]
    assert len(set(texts)) > 1  # n different samples, not one copied
    chunks = stream(server, stream_options={"include_usage": True}, **kw)
    assert texts_by_index(chunks[:-1]) == dict(enumerate(texts))  # seeded: the same samples
    finishes = [c["index"] for ch in chunks for c in ch["choices"] if c.get("finish_reason")]
    assert sorted(finishes) == [0, 1, 2] and chunks[-1]["usage"] == whole["usage"]


@needs_n
def test_batch_times_n_numbers_choices_by_prompt_then_sample(server):
    whole = post(server, prompt=PROMPTS[:2], n=2, max_tokens=4, temperature=0, ignore_eos=True)
    alone = [post(server, prompt=p, max_tokens=4, temperature=0, ignore_eos=True)["choices"][0]["text"]
             for p in PROMPTS[:2]]
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in whole["choices"]] == [alone[0], alone[0], alone[1], alone[1]]
    assert whole["usage"]["completion_tokens"] == 4 * 4


@needs_n
def test_chat_stream_with_n_opens_every_choice(server):
    chunks = stream(server, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}],
                    n=2, max_tokens=3, temperature=1.0, seed=3)
    roles = [c["index"] for ch in chunks for c in ch["choices"] if c["delta"].get("role")]
    assert roles == [0, 1]
    assert set(texts_by_index(chunks, key="delta")) == {0, 1}
