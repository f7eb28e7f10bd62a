"""Issue 8 at the HTTP door: bad values refused where they enter (400 naming the field, the
connection kept), limits checked before any tokenization, tokenization off the event loop, parse
errors that say where, and streams that end readably when the drain timeout runs out."""

import http.client
import json
import socket
import threading
import time

import httpx
import pytest

from minserve.engine.llm_engine import LLMEngine
from minserve.server import create_app
from minserve.server.cli import build_parser, make_server, request_limits
from minserve.server.limits import CHARS_PER_TOKEN_BOUND, RequestLimits
from minserve.server.protocol import MAX_DOCUMENTS, MAX_MESSAGES, MAX_TOOLS
from live_server import live_server

PROMPT = "The quick brown fox"


def tiny_engine(**kw):
    kw = {"max_num_seqs": 2, "max_num_batched_tokens": 128, "num_kv_blocks": 64, **kw}
    return LLMEngine.from_engine_args("tiny-llama", **kw)


@pytest.fixture(scope="module")
def server():
    engine = tiny_engine()
    with live_server(create_app(engine)) as base:
        yield base, engine


def post_raw(base: str, path: str, body: dict, **kw) -> httpx.Response:
    # json.dumps writes a lone surrogate as the escape "\ud800", as a client's JSON encoder would.
    return httpx.post(base + path, content=json.dumps(body).encode(), timeout=30,
                      headers={"content-type": "application/json"}, **kw)


def assert_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return err


class CountingTokenizer:
    """Stands in for engine.tokenizer on the HTTP side: counts calls, can hold them at a gate,
    and records the thread that ran them."""

    def __init__(self, real, gate: threading.Event | None = None):
        self.real, self.gate = real, gate
        self.calls, self.threads = 0, []
        self.entered = threading.Event()

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.threads.append(threading.current_thread())
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(30), "the test never opened the gate"
        return self.real(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)


# ---- item 2: values validated where the request enters ------------------------------------------

SURROGATE = "\ud800"
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"


def chat(**message) -> dict:
    return {"messages": [{"role": "user", "content": "hi", **message}], "max_tokens": 2}


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS_PATH, {"prompt": f"hi {SURROGATE}"}, "prompt"),
    (COMPLETIONS_PATH, {"prompt": [f"hi {SURROGATE}"]}, "prompt.0"),
    (COMPLETIONS_PATH, {"prompt": PROMPT, "stop": ["ok", SURROGATE]}, "stop.1"),
    (COMPLETIONS_PATH, {"prompt": PROMPT, "stop": "\udfff"}, "stop"),
    (COMPLETIONS_PATH, {"prompt": PROMPT, "cache_salt": SURROGATE}, "cache_salt"),
    (COMPLETIONS_PATH, {"prompt": PROMPT, "user": SURROGATE}, "user"),
    (COMPLETIONS_PATH, {"prompt": PROMPT, "model": SURROGATE}, "model"),
    (CHAT_PATH, chat(content=f"a{SURROGATE}"), "messages.0.content"),
    (CHAT_PATH, chat(content=[{"type": "text", "text": SURROGATE}]), "messages.0.content.0.text"),
    (CHAT_PATH, chat(name=SURROGATE), "messages.0.name"),
    (CHAT_PATH, chat(role=SURROGATE), "messages.0.role"),
    # Inside free-form objects (issue 20 item 5: these were 500s), keys and values alike.
    (CHAT_PATH, {**chat(), "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {SURROGATE: {"type": "string"}}}}}]},
     f"tools.0.function.parameters.properties.{SURROGATE}"),
    (CHAT_PATH, {**chat(), "chat_template_kwargs": {"x": [1, SURROGATE]}}, "chat_template_kwargs.x.1"),
    (COMPLETIONS_PATH, {"prompt": PROMPT, "structured_outputs": {"json": {"enum": [SURROGATE]}}},
     "structured_outputs.json.enum.0"),
    ("/tokenize", {"prompt": SURROGATE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": f"a{SURROGATE}"}]}, "messages.0.content"),
])
def test_lone_surrogates_are_400_naming_the_field(server, path, body, param):
    base, _ = server
    extra = {} if path == "/tokenize" else {"max_tokens": 2}
    err = assert_error(post_raw(base, path, {**extra, **body}), 400, param.encode("utf-8", "backslashreplace").decode())
    assert "surrogate" in err["message"] and err["message"].isascii()


def test_after_a_bad_value_the_kept_alive_connection_still_serves(server):
    base, _ = server
    conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=30)
    try:
        def post(body: dict) -> tuple[int, dict]:
            conn.request("POST", COMPLETIONS_PATH, json.dumps(body), {"content-type": "application/json"})
            r = conn.getresponse()
            return r.status, json.loads(r.read())

        status, out = post({"prompt": f"x{SURROGATE}", "max_tokens": 2})
        assert (status, out["error"]["param"]) == (400, "prompt")
        sock = conn.sock
        assert sock is not None  # the server did not ask to close it
        status, out = post({"prompt": PROMPT, "max_tokens": 2})
        assert status == 200 and out["usage"]["completion_tokens"] == 2
        assert conn.sock is sock  # the same connection served both
    finally:
        conn.close()


def test_min_tokens_with_every_token_a_stop_token_is_400(server):
    base, engine = server
    vocab, eos = engine.model_config.vocab_size, engine.eos_token_ids
    all_but_eos = [t for t in range(vocab) if t not in eos]
    body = {"prompt": PROMPT, "max_tokens": 2, "min_tokens": 1, "stop_token_ids": all_but_eos}
    err = assert_error(post_raw(base, COMPLETIONS_PATH, body), 400, "stop_token_ids")
    assert "min_tokens" in err["message"]
    # With ignore_eos the EOS token is not banned, so there is something left to sample.
    assert post_raw(base, COMPLETIONS_PATH, {**body, "ignore_eos": True}).status_code == 200


def test_bad_requests_leave_a_stream_in_flight_alone(server):
    base, engine = server
    body = {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base + COMPLETIONS_PATH, json=body, timeout=30) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        for bad in ({"prompt": PROMPT, "cache_salt": SURROGATE}, {"prompt": SURROGATE},
                    {"prompt": PROMPT, "min_tokens": 1, "stop_token_ids": list(range(
                        engine.model_config.vocab_size))}):
            assert post_raw(base, COMPLETIONS_PATH, {"max_tokens": 2, **bad}).status_code == 400
        events = [first] + [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


# ---- item 5: limits before tokenization, tokenization off the event loop ------------------------

def test_prompt_chars_are_capped_before_tokenizing(server):
    base, engine = server
    cap = engine.max_model_len * CHARS_PER_TOKEN_BOUND
    counting = engine.tokenizer = CountingTokenizer(engine.tokenizer)
    try:
        err = assert_error(post_raw(base, COMPLETIONS_PATH, {"prompt": "a" * (cap + 1)}), 400, "prompt")
        assert str(cap) in err["message"] and f"max_model_len={engine.max_model_len}" in err["message"]
        halves = [{"role": "user", "content": "b" * (cap // 2 + 1)}] * 2
        assert_error(post_raw(base, CHAT_PATH, {"messages": halves}), 400, "messages")
        assert counting.calls == 0
    finally:
        engine.tokenizer = counting.real


def test_stop_strings_are_bounded(server):
    base, _ = server
    limits = RequestLimits()
    many = [f"s{i}" for i in range(limits.max_stop_strings + 1)]
    err = assert_error(post_raw(base, COMPLETIONS_PATH, {"prompt": PROMPT, "stop": many}), 400, "stop")
    assert str(limits.max_stop_strings) in err["message"]
    long = ["ok", "x" * (limits.max_stop_chars + 1)]
    assert_error(post_raw(base, COMPLETIONS_PATH, {"prompt": PROMPT, "stop": long}), 400, "stop.1")
    ok = {"prompt": PROMPT, "max_tokens": 2, "stop": many[:limits.max_stop_strings]}
    assert post_raw(base, COMPLETIONS_PATH, ok).status_code == 200


def over(limit: int, item=lambda i: f"w{i}") -> list:
    return [item(i) for i in range(limit + 1)]


# Issue 20 item 2: every list field is bounded (200 k bad words froze every stream for 10 s).
@pytest.mark.parametrize("field, value, param, limit", [
    ("bad_words", over(RequestLimits.max_bad_words), "bad_words", RequestLimits.max_bad_words),
    ("bad_words", ["ok", "x" * (RequestLimits.max_bad_word_chars + 1)], "bad_words.1",
     RequestLimits.max_bad_word_chars),
    ("structured_outputs", {"choice": over(RequestLimits.max_choices)}, "structured_outputs.choice",
     RequestLimits.max_choices),
    ("structured_outputs", {"choice": ["a", "b" * (RequestLimits.max_choice_chars + 1)]},
     "structured_outputs.choice.1", RequestLimits.max_choice_chars),
    ("guided_choice", over(RequestLimits.max_choices), "guided_choice", RequestLimits.max_choices),
    ("request_id", "r" * (RequestLimits.max_label_chars + 1), "request_id", RequestLimits.max_label_chars),
    ("user", "u" * (RequestLimits.max_label_chars + 1), "user", RequestLimits.max_label_chars),
])
def test_list_fields_are_bounded_with_a_400_naming_field_and_limit(server, field, value, param, limit):
    base, _ = server
    err = assert_error(post_raw(base, COMPLETIONS_PATH, {"prompt": PROMPT, field: value}), 400, param)
    assert str(limit) in err["message"]


def test_token_id_lists_may_name_each_token_once_and_no_more(server):
    base, engine = server
    vocab = engine.model_config.vocab_size
    for field, value in (("allowed_token_ids", list(range(vocab)) + [0]),
                         ("stop_token_ids", [1] * (vocab + 1)),
                         ("logit_bias", {str(t): 0.5 for t in range(vocab)} | {"00": 1.0})):
        err = assert_error(post_raw(base, COMPLETIONS_PATH, {"prompt": PROMPT, field: value}), 400, field)
        assert str(vocab) in err["message"], err
    # The whole vocabulary once is a real use, and is served.
    for field, value in (("allowed_token_ids", list(range(vocab))),
                         ("logit_bias", {str(t): 0.5 for t in range(vocab)})):
        r = post_raw(base, COMPLETIONS_PATH, {"prompt": PROMPT, "max_tokens": 2, field: value})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("field, item, most", [
    ("tools", {"type": "function", "function": {"name": "f"}}, MAX_TOOLS),
    ("messages", {"role": "user", "content": ""}, MAX_MESSAGES),
    ("documents", {"title": "t"}, MAX_DOCUMENTS),
])
def test_lists_of_objects_are_bounded_in_the_schema(server, field, item, most):
    """Bounded while parsing (pydantic stops at the first item past the bound): 110 k empty
    messages used to take ~0.5 s of the event loop, every stream frozen meanwhile."""
    base, _ = server
    body = {**chat(), field: [item] * (most + 1)}
    err = assert_error(post_raw(base, CHAT_PATH, body), 400, field)
    assert f"at most {most} items" in err["message"], err
    if field == "messages":
        assert_error(post_raw(base, "/tokenize", {"messages": body["messages"]}), 400, field)


# Issue 20 item 8: JSON booleans are not numbers (pydantic's lax mode took true as 1).
@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS_PATH, {"prompt": PROMPT, "max_tokens": True}, "max_tokens"),
    (COMPLETIONS_PATH, {"prompt": PROMPT, "temperature": False}, "temperature"),
    (COMPLETIONS_PATH, {"prompt": PROMPT, "n": True}, "n"),
    (COMPLETIONS_PATH, {"prompt": PROMPT, "seed": False}, "seed"),
    (COMPLETIONS_PATH, {"prompt": [True, False]}, "prompt"),
    (COMPLETIONS_PATH, {"prompt": PROMPT, "allowed_token_ids": [True]}, "allowed_token_ids.0"),
    (COMPLETIONS_PATH, {"prompt": PROMPT, "logit_bias": {"5": True}}, "logit_bias.5"),
    (CHAT_PATH, {**chat(), "max_completion_tokens": True}, "max_completion_tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens.0"),
])
def test_booleans_are_refused_where_a_number_or_id_is_expected(server, path, body, param):
    base, _ = server
    r = post_raw(base, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].split(".")[0] == param.split(".")[0] and param in err["message"], err
    assert "bool" in err["message"] or "valid" in err["message"], err


def test_health_answers_while_a_prompt_is_tokenized(server):
    """The tokenizer is held at a gate until /health has answered: if tokenization ran on the event
    loop, /health could not answer and the test would time out instead."""
    base, engine = server
    gate = threading.Event()
    gated = engine.tokenizer = CountingTokenizer(engine.tokenizer, gate)
    result = {}
    worker = threading.Thread(target=lambda: result.update(r=post_raw(
        base, COMPLETIONS_PATH, {"prompt": PROMPT * 200, "max_tokens": 2})))
    try:
        worker.start()
        assert gated.entered.wait(30)
        assert httpx.get(base + "/health", timeout=5).status_code == 200
    finally:
        gate.set()
        worker.join(30)
        engine.tokenizer = gated.real
    assert result["r"].status_code == 200, result["r"].text
    assert gated.threads[0].name.startswith("minserve-prepare")


def test_body_size_is_capped_with_413_before_parsing():
    engine = tiny_engine()
    with live_server(create_app(engine, limits=RequestLimits(max_body_bytes=1000))) as base:
        big = {"prompt": "a" * 2000, "max_tokens": 2}
        err = assert_error(post_raw(base, COMPLETIONS_PATH, big), 413, "body")
        assert "1000" in err["message"] and err["code"] == "body_too_large"

        def chunks():  # no Content-Length: the limit is enforced while the body arrives
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"a" * 200
            yield b'"}'
        r = httpx.post(base + COMPLETIONS_PATH, content=chunks(), timeout=30,
                       headers={"content-type": "application/json"})
        assert_error(r, 413, "body")
        assert r.headers["connection"] == "close"
        assert post_raw(base, COMPLETIONS_PATH, {"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_cli_flags_reach_the_limits():
    a = build_parser().parse_args(["--max-request-body-bytes", "2048", "--max-prompt-chars", "100"])
    limits = request_limits(a)
    assert (limits.max_body_bytes, limits.prompt_chars(4096)) == (2048, 100)
    default = request_limits(build_parser().parse_args([]))
    assert default == RequestLimits() and default.prompt_chars(512) == 512 * CHARS_PER_TOKEN_BOUND
    with pytest.raises(ValueError, match="max_body_bytes"):
        request_limits(build_parser().parse_args(["--max-request-body-bytes", "0"]))


# ---- item 9: parse errors that say where, drains that end streams readably ----------------------

@pytest.mark.parametrize("raw, param, words", [
    (b'{"prompt": "x",\n  "max_tokens": }', "body.32", "line 2, column 17"),
    (b'{"prompt": "\xed\xa0\x80"}', "body.12", "byte 0xed at byte offset 12"),  # a UTF-8 surrogate
    (b"\xff", "body.0", "not valid UTF-8"),
    (b"[" * 100_000, "body", "parsing the body"),  # too deep for json.loads
])
def test_body_parse_errors_name_the_position(server, raw, param, words):
    base, _ = server
    r = httpx.post(base + COMPLETIONS_PATH, content=raw, headers={"content-type": "application/json"})
    assert words in assert_error(r, 400, param)["message"]


def test_streams_cut_by_the_drain_timeout_end_with_an_error_and_done():
    engine = tiny_engine()
    real = engine.runner.execute

    def slow(*args, **kwargs):  # ~50 steps a second: 1000 tokens outlast the drain timeout
        time.sleep(0.02)
        return real(*args, **kwargs)

    engine.runner.execute = slow
    app = create_app(engine)
    srv = make_server(app, "127.0.0.1", 0, drain_timeout_s=0.5, log_level="warning")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not srv.started:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        body = {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True}
        plain = {}
        waiter = threading.Thread(target=lambda: plain.update(r=post_raw(
            base, COMPLETIONS_PATH, {**body, "stream": False})))
        waiter.start()
        with httpx.stream("POST", base + COMPLETIONS_PATH, json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            while len(engine.scheduler.running) < 2:  # the plain request runs too
                time.sleep(0.01)
            srv.handle_exit(15, None)  # SIGTERM, as the signal handler would get it
            events = [line[6:] for line in lines if line.startswith("data: ")]
        waiter.join(30)
        thread.join(30)
        assert not thread.is_alive()
    finally:
        srv.should_exit = True
        thread.join(15)
        sock.close()
    assert events[-1] == "[DONE]", events[-3:]
    err = json.loads(events[-2])["error"]
    assert "drain timeout of 0.5 s" in err["message"] and err["code"] == "draining"
    assert "drain timeout" in assert_error(plain["r"], 503, None)["message"]
    pool = engine.kv.pool
    assert pool.num_free == pool.num_blocks and not engine.has_unfinished_requests()
