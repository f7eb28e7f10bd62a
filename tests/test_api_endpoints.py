"""vLLM's small endpoints (/tokenize, /detokenize, /tokenizer_info, /version, /v1/models/{id}),
HEAD wherever GET exists, and usage's cached_tokens with prefix caching on."""

import json

import httpx
import openai
import pytest

import minserve
from live_server import live_server, served
from live_server import post_json as post
from minserve.engine.llm_engine import LLMEngine
from minserve.server import create_app

CHAT = [{"role": "user", "content": "Say something nice."}]
GET_ROUTES = ["/health", "/metrics", "/v1/models", "/v1/models/tiny-llama", "/version", "/tokenizer_info"]


@pytest.fixture(scope="module")
def server():
    with served(LLMEngine.from_engine_args("tiny-llama", max_num_seqs=4, max_num_batched_tokens=128,
                                           num_kv_blocks=128, enable_prefix_caching=True)) as srv:
        yield srv


def test_tokenize_and_detokenize_round_trip(server):
    text = "Hello world, tokenized by the server."
    for special in (True, False):
        out = post(server, "/tokenize", prompt=text, add_special_tokens=special)
        ids = server.tok(text, add_special_tokens=special).input_ids
        assert out == {"count": len(ids), "max_model_len": server.engine.max_model_len,
                       "tokens": ids, "token_strs": None}
    strs = post(server, "/tokenize", prompt=text, return_token_strs=True)["token_strs"]
    assert strs == server.tok.convert_ids_to_tokens(ids)
    assert post(server, "/detokenize", tokens=ids) == {"prompt": text}


def test_tokenize_messages_counts_what_chat_completions_charges(server):
    ids = post(server, "/tokenize", messages=CHAT)["tokens"]
    chat = post(server, "/v1/chat/completions", messages=CHAT, max_tokens=1)
    assert chat["usage"]["prompt_tokens"] == len(ids)
    assert server.tok.decode(ids).endswith("<|im_start|>assistant\n")  # the generation prompt
    bare = post(server, "/tokenize", messages=CHAT, add_generation_prompt=False)["tokens"]
    assert ids[:len(bare)] == bare and len(bare) < len(ids)


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "gpt-9"}, 404, "model"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_bad_tokenizer_requests_are_clear_4xx(server, path, body, status, param):
    err = post(server, path, status, **body)["error"]
    assert err["param"] == param and set(err) == {"message", "type", "param", "code"}


def test_version_and_model_cards(server):
    assert httpx.get(server.base + "/version").json() == {"version": minserve.__version__}
    card = server.client.models.retrieve("tiny-llama")
    listed = server.client.models.list().data[0]
    assert card.id == "tiny-llama" and card.model_dump() == listed.model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        server.client.models.retrieve("gpt-9")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


@pytest.mark.parametrize("path", GET_ROUTES)
def test_head_wherever_get_exists(server, path):
    get, head = httpx.get(server.base + path), httpx.head(server.base + path)
    assert get.status_code == head.status_code == 200
    assert head.content == b"" and head.headers.get("content-type") == get.headers.get("content-type")
    assert httpx.head(server.base + "/v1/models/gpt-9").status_code == 404


def test_tokenizer_info_lets_lm_eval_tokenize_through_the_server(server):
    info = httpx.get(server.base + "/tokenizer_info").json()
    assert info["eos_token"] == server.tok.eos_token and info["chat_template"] == server.tok.chat_template
    assert info["tokenizer_class"] == type(server.tok).__name__
    utils = pytest.importorskip("lm_eval.utils")
    assert utils.check_remote_tokenizer_support(server.base)
    remote = utils.RemoteTokenizer(server.base)
    assert remote.encode("Hello there") == server.tok("Hello there", add_special_tokens=False).input_ids
    assert remote.eos_token_id == server.tok.eos_token_id


def test_cached_tokens_are_reported_when_the_prefix_cache_hits(server):
    prompt = " ".join(f"word{i}" for i in range(40))  # well over two 16-token blocks
    n = len(server.tok(prompt).input_ids)
    first = post(server, "/v1/completions", prompt=prompt, max_tokens=1)["usage"]
    again = post(server, "/v1/completions", prompt=prompt, max_tokens=1)["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    hit = again["prompt_tokens_details"]["cached_tokens"]
    assert hit % 16 == 0 and n - 16 <= hit < n  # every whole block but the last token's
    body = {"prompt": prompt, "max_tokens": 1, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=60) as r:
        last = [line for line in r.iter_lines() if line.startswith("data: {")][-1]
    assert json.loads(last[6:])["usage"]["prompt_tokens_details"] == {"cached_tokens": hit}
    # Another tenant (the openai client sends a key) shares nothing: the cache is salted by tenant.
    other = server.client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=1)
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_tokenizer_routes_need_a_key_when_keys_are_configured():
    from minserve.server import Auth, Principal
    engine = LLMEngine.from_engine_args("tiny-llama", num_kv_blocks=16)  # one app per engine
    app = create_app(engine, auth=Auth({"sk-a": Principal("acme")}))
    with live_server(app) as base:
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
            assert httpx.post(base + path, json=body).status_code == 401
            ok = httpx.post(base + path, json=body, headers={"Authorization": "Bearer sk-a"})
            assert ok.status_code == 200
        assert httpx.get(base + "/tokenizer_info").status_code == 401
        assert httpx.get(base + "/version").status_code == 200  # no work, nothing to protect
        assert httpx.get(base + "/health").status_code == 200
