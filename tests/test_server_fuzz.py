"""Property: whatever a client sends, the server answers with a 2xx or 4xx, never a 5xx.

Bodies are dicts over the known fields with plausible, boundary and wrong-typed values, plus random
extra keys; also raw bytes and odd headers. FastAPI's TestClient drives the real app (engine
thread included) in-process, which is fast enough for a few hundred examples. ``max_model_len`` is
small so that any request the fuzzer makes valid still finishes in a few dozen tokens.
"""

import json
import string

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minserve.engine.llm_engine import LLMEngine
from minserve.server import create_app

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

scalar = (st.none() | st.booleans() | st.integers(-(10**20), 10**20)
          | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
json_value = st.recursive(scalar, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bot"]),
                                 "content": st.text(max_size=20)})
# Right-typed values, in and out of range, per field.
PLAUSIBLE = {
    "model": st.sampled_from(["tiny-llama", "other"]),
    "prompt": st.text(max_size=30) | st.lists(st.integers(-3, 60000), max_size=6)
    | st.lists(st.text(max_size=5), max_size=2),
    "messages": st.lists(message, max_size=3),
    "max_tokens": st.integers(-2, 6),
    "max_completion_tokens": st.integers(-2, 6),
    "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-3, 100),
    "min_p": st.floats(-0.5, 1.5),
    "seed": st.integers(-5, 2**64 + 5),
    "n": st.integers(0, 3),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(-2, 60000), max_size=3),
    "min_tokens": st.integers(-2, 8),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logprobs": st.booleans() | st.integers(-1, 25),
    "top_logprobs": st.integers(-1, 25),
    "echo": st.booleans(),
    "ignore_eos": st.booleans(),
    "cache_salt": st.text(max_size=5),
    "priority": st.integers(-3, 3),
    "deadline_ms": st.floats(-10, 10**6),
    "user": st.text(max_size=8),
}
extra_keys = st.dictionaries(st.text(max_size=10), json_value, max_size=3)
# Anything goes: every known field optional, each plausible or of a random JSON type.
wild_bodies = st.builds(lambda known, extra: {**extra, **known},
                        st.fixed_dictionaries({}, optional={k: v | json_value for k, v in PLAUSIBLE.items()}),
                        extra_keys)


@st.composite
def near_valid_bodies(draw, path: str) -> dict:
    """A valid request with up to two fields changed (so most runs reach the engine)."""
    body = ({"messages": [{"role": "user", "content": draw(st.text(min_size=1, max_size=20))}]}
            if path.endswith("chat/completions") else {"prompt": draw(st.text(min_size=1, max_size=20))})
    body["max_tokens"] = draw(st.integers(1, 6))
    for key in draw(st.lists(st.sampled_from(sorted(PLAUSIBLE)), max_size=2, unique=True)):
        body[key] = draw(PLAUSIBLE[key] | json_value if draw(st.integers(0, 4)) == 0 else PLAUSIBLE[key])
    body.update(draw(st.dictionaries(st.text(max_size=10), json_value, max_size=1)))
    return body


header_text = st.text(alphabet=string.ascii_letters + string.digits + " -_.", max_size=12)
odd_headers = st.fixed_dictionaries({}, optional={"x-priority-class": header_text | st.just("batch"),
                                              "x-deadline-ms": header_text | st.just("50"),
                                              "authorization": header_text.map("Bearer ".__add__)})
headers = st.one_of(st.just({}), st.just({"authorization": "Bearer k"}), odd_headers)
paths = st.sampled_from(["/v1/completions", "/v1/chat/completions"])


@pytest.fixture(scope="module")
def client():
    engine = LLMEngine.from_engine_args("tiny-llama", max_num_seqs=4, max_num_batched_tokens=128,
                                        num_kv_blocks=32, max_model_len=64)
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        c.engine = engine
        yield c
    pool = engine.kv.pool
    assert pool.num_free == pool.num_blocks and not engine.has_unfinished_requests()


def check(r) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and set(err) == {"message", "type", "param", "code"}
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n")
        assert '"error"' not in r.text, r.text


@SETTINGS
@given(path=paths, data=st.data(), hdrs=headers)
def test_random_bodies_never_5xx(client, path, data, hdrs):
    body = data.draw(st.one_of(wild_bodies, near_valid_bodies(path), near_valid_bodies(path)))
    # Encoded here: the client refuses NaN/Infinity, which Python's (and FastAPI's) parser accepts.
    raw = json.dumps(body).encode()
    check(client.post(path, content=raw, headers={**hdrs, "content-type": "application/json"}))


@SETTINGS
@given(path=paths, raw=st.binary(max_size=120) | st.text(max_size=60).map(str.encode),
       content_type=st.sampled_from(["application/json", "text/plain", ""]))
def test_raw_bytes_never_5xx(client, path, raw, content_type):
    r = client.post(path, content=raw, headers={"content-type": content_type} if content_type else {})
    check(r)
    assert r.status_code >= 400  # nothing here is a valid request


# Text with lone surrogates (JSON "\ud800"): Python strings hold them, UTF-8 cannot (issue 8.2).
surrogate_text = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
                         | st.characters(max_codepoint=0x7F), min_size=1, max_size=6).filter(
    lambda t: any(0xD800 <= ord(c) <= 0xDFFF for c in t))
STRING_FIELDS = {
    "prompt": lambda t: t, "stop": lambda t: ["ok", t], "cache_salt": lambda t: t,
    "user": lambda t: t, "model": lambda t: t,
    "messages": lambda t: [{"role": "user", "content": [{"type": "text", "text": t}]}],
}


@settings(SETTINGS, max_examples=60)
@given(path=paths, data=st.data(), field=st.sampled_from(sorted(STRING_FIELDS)), text=surrogate_text)
def test_lone_surrogates_are_400_naming_the_field(client, path, data, field, text):
    body = data.draw(near_valid_bodies(path))
    body[field] = STRING_FIELDS[field](text)
    r = client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    check(r)
    if r.status_code == 400 and "surrogate" in r.json()["error"]["message"]:
        assert r.json()["error"]["param"].split(".")[0] == field


def test_server_still_serves_after_fuzzing(client):
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert client.get("/health").status_code == 200
