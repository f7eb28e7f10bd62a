"""Issue 20, item 1: a client's ``request_id`` is a label, never a key into someone else's work.

The attack: tenant A streams with ``"request_id": "X"``; tenant B sends a stream with the same id
and closes its socket at once. B's abort used to reach A's request (the engine keyed requests by
the client's id): A's stream stopped after a few tokens and then sent nothing, no finish and no
error, until the client gave up. Had B waited instead, it was told the id was "already in use",
an oracle for which ids other tenants had in flight.
"""

import json
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from live_server import live_server
from minserve.engine.llm_engine import LLMEngine
from minserve.server import create_app

TOKENS = 48


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine.from_engine_args("tiny-llama", max_num_seqs=4, num_kv_blocks=128)
    real = engine.runner.execute

    def slow(*args, **kwargs):  # 5 ms a step: A's 48 tokens outlast B's whole attempt
        time.sleep(0.005)
        return real(*args, **kwargs)

    engine.runner.execute = slow
    app = create_app(engine)
    with live_server(app) as base:
        yield SimpleNamespace(base=base, engine=engine, async_engine=app.state.minserve.async_engine)


def body(**extra) -> dict:
    return {"prompt": "The quick brown fox", "max_tokens": TOKENS, "ignore_eos": True,
            "temperature": 0, "request_id": "X", **extra}


def read_stream(base: str, key: str, out: dict) -> None:
    events = []
    with httpx.stream("POST", base + "/v1/completions", json=body(stream=True, stream_options={"include_usage": True}),
                      timeout=30, headers={"Authorization": f"Bearer {key}"}) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 2:
                    out["started"].set()
    out["events"] = events


def send_and_hang_up(base: str, key: str) -> None:
    """B's stream with A's id, the socket closed right after the request is sent."""
    payload = json.dumps(body(stream=True)).encode()
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {key}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                  + payload)


def test_another_tenant_reusing_an_id_cannot_abort_the_stream(server):
    a = {"started": threading.Event()}
    reader = threading.Thread(target=read_stream, args=(server.base, "sk-tenant-a", a))
    reader.start()
    assert a["started"].wait(30)
    for _ in range(3):
        send_and_hang_up(server.base, "sk-tenant-b")
    reader.join(30)
    assert not reader.is_alive(), "A's stream hung"
    events = a["events"]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks[-1]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == TOKENS  # every token arrived
    assert {c["id"] for c in chunks} == {"cmpl-X"}  # the client's label is kept on the response


def test_an_id_in_flight_is_not_revealed_and_both_requests_are_served(server):
    a = {"started": threading.Event()}
    reader = threading.Thread(target=read_stream, args=(server.base, "sk-tenant-a", a))
    reader.start()
    assert a["started"].wait(30)
    # Another tenant and the same tenant, both with the id A's stream holds: no "already in use".
    for key in ("sk-tenant-b", "sk-tenant-a"):
        r = httpx.post(server.base + "/v1/completions", json=body(max_tokens=4), timeout=30,
                       headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        assert r.json()["id"] == "cmpl-X" and r.json()["usage"]["completion_tokens"] == 4
    reader.join(30)
    assert a["events"][-1] == "[DONE]" and "error" not in a["events"][-2]
    pool = server.engine.kv.pool
    deadline = time.monotonic() + 5
    while pool.num_free != pool.num_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.num_free == pool.num_blocks


def test_a_stream_whose_request_is_aborted_ends_with_an_error_event(server):
    """Whatever takes a request away from its stream (here: an abort sent straight to the engine
    thread, as no client can any more), the stream ends with an error event, never silence."""
    out = {"started": threading.Event()}
    reader = threading.Thread(target=read_stream, args=(server.base, "sk-tenant-c", out))
    reader.start()
    assert out["started"].wait(30)
    running = [r.request_id for r in list(server.engine.scheduler.running)]
    assert len(running) == 1 and running[0].startswith("cmpl-X@")  # the server's own key
    server.async_engine.abort(running[0])
    reader.join(10)
    assert not reader.is_alive(), "the stream hung after its request was aborted"
    last = json.loads(out["events"][-2])
    assert out["events"][-1] == "[DONE]" and last["error"]["code"] == "aborted"
