"""Over HTTP, one request must never fail the requests batched with it (issue 8, items 1 and 2):
a logprobs request beside plain streams, and a failure injected for one request in a busy step."""

import asyncio
import json

import httpx
import pytest

from minserve.engine.llm_engine import LLMEngine
from minserve.server import create_app
from live_server import live_server

LONG = {"prompt": "Once upon a time", "max_tokens": 60, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine.from_engine_args("tiny-llama", max_num_seqs=8, max_num_batched_tokens=128,
                                        num_kv_blocks=128)
    with live_server(create_app(engine)) as base:
        yield base, engine


def _count(engine, reason: str) -> float:
    return engine.snapshot().get(f'vllm:request_success{{finished_reason="{reason}"}}', 0.0)


async def _stream(client, base, body) -> list:
    """All SSE events of one streamed completion (dicts, and the final "[DONE]")."""
    events = []
    async with client.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def _beside_long_streams(base, side_requests):
    """Two long streams start; once they produce tokens, the side requests go in beside them."""
    async with httpx.AsyncClient(timeout=60) as client:
        streams = [asyncio.create_task(_stream(client, base, LONG)) for _ in range(2)]
        await asyncio.sleep(0.3)
        side = await asyncio.gather(*(client.post(f"{base}{path}", json=body)
                                      for path, body in side_requests))
        return await asyncio.gather(*streams), side


def _assert_complete(stream_events):
    assert stream_events[-1] == "[DONE]"
    finishes = [e["choices"][0]["finish_reason"] for e in stream_events[:-1] if e["choices"]]
    assert "error" not in json.dumps(stream_events) and finishes[-1] == "length"


def test_logprobs_requests_beside_plain_streams(server):
    base, engine = server
    errors, aborts = _count(engine, "error"), _count(engine, "abort")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "logprobs": True}
    streams, side = asyncio.run(_beside_long_streams(base, [
        ("/v1/completions", {"prompt": "x", "max_tokens": 5, "logprobs": 1}),
        ("/v1/chat/completions", chat)]))
    for events in streams:
        _assert_complete(events)
        assert all(e["choices"][0]["logprobs"] is None for e in events[:-1] if e["choices"])
    comp, chat_resp = (r.json() for r in side)
    assert side[0].status_code == side[1].status_code == 200
    assert len(comp["choices"][0]["logprobs"]["token_logprobs"]) == comp["usage"]["completion_tokens"]
    assert len(chat_resp["choices"][0]["logprobs"]["content"]) == chat_resp["usage"]["completion_tokens"]
    assert (_count(engine, "error"), _count(engine, "abort")) == (errors, aborts)


def test_failure_of_one_request_is_its_own(server, monkeypatch):
    base, engine = server
    real = engine.output_processor.append_token
    poison = engine.tokenizer("poison").input_ids

    def append_token(req, *args):
        if req.prompt_token_ids == poison:
            raise RuntimeError("injected failure")
        return real(req, *args)

    monkeypatch.setattr(engine.output_processor, "append_token", append_token)
    errors = _count(engine, "error")
    streams, side = asyncio.run(_beside_long_streams(base, [
        ("/v1/completions", {"prompt": "poison", "max_tokens": 5})]))
    for events in streams:
        _assert_complete(events)
    assert side[0].status_code == 500 and "injected failure" in side[0].json()["error"]["message"]
    assert _count(engine, "error") == errors + 1
    pool = engine.kv.pool
    assert pool.num_free == pool.num_blocks and not engine.has_unfinished_requests()


# Issue 20 item 3: requests whose constraints leave no legal token. What can be decided at the
# door is a 400 naming the fields; what only shows mid-run fails that request alone, as a 400
# (its own doing, not the server's), and its neighbours' streams go on untouched.
def test_poison_requests_decidable_at_the_door_are_400(server):
    base, engine = server
    eos = engine.eos_token_ids[0]
    r = httpx.post(f"{base}/v1/completions", timeout=30, json={
        "prompt": "x", "max_tokens": 5, "allowed_token_ids": [eos], "min_tokens": 3})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "allowed_token_ids" and "min_tokens" in err["message"]
    r = httpx.post(f"{base}/v1/completions", timeout=30, json={
        "prompt": "x", "max_tokens": 20, "structured_outputs": {"choice": ["yes"]}, "min_tokens": 10})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "min_tokens" and "structured_outputs" in r.json()["error"]["message"]


def test_a_request_unsatisfiable_mid_run_is_a_400_of_its_own(server):
    """A regex that must end after two characters, with min_tokens 6: only EOS is left once the
    grammar is done, and EOS is banned. Nothing at the door can know how many tokens "aa" takes."""
    base, engine = server
    poison = {"prompt": "x", "max_tokens": 10, "min_tokens": 6, "structured_outputs": {"regex": "aa"}}
    errors = _count(engine, "error")
    streams, side = asyncio.run(_beside_long_streams(base, [("/v1/completions", poison)] * 3))
    for events in streams:
        _assert_complete(events)
    for r in side:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "unsatisfiable_constraints" and "min_tokens" in err["message"], err
    assert _count(engine, "error") == errors + 3
    pool = engine.kv.pool
    assert pool.num_free == pool.num_blocks and not engine.has_unfinished_requests()
