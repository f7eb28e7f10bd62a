"""Completions ``echo`` with ``logprobs`` and vLLM's ``prompt_logprobs`` over HTTP, checked against
transformers (the prompt part) and against the same request without echo (the completion part)."""

import json

import httpx
import pytest
import torch

from live_server import post_json as post
from live_server import served
from minserve.engine.llm_engine import LLMEngine
from reference import hf_model

TOL = 1e-4  # nats: two fp32 implementations of one model
PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def server():
    with served(LLMEngine.from_engine_args("tiny-llama", max_num_seqs=4, max_num_batched_tokens=128,
                                           num_kv_blocks=128)) as srv:
        yield srv


def hf_logprobs(server, ids: list[int]) -> torch.Tensor:
    """transformers' log-distributions [len(ids) - 1, vocab] of each next prompt token."""
    with torch.no_grad():
        logits = hf_model(str(server.engine.config_path))(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def check_prompt_part(server, ids: list[int], lp: dict, k: int) -> None:
    """The first len(ids) entries of a completions ``logprobs`` are the prompt's, vLLM's way."""
    tok, ref = server.tok, hf_logprobs(server, ids)
    assert lp["tokens"][0] == tok.decode([ids[0]])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts it
    checked = 0
    for i in range(1, len(ids)):
        row, actual = ref[i - 1], ids[i]
        assert lp["tokens"][i] == tok.decode([actual])
        assert abs(lp["token_logprobs"][i] - row[actual].item()) < TOL, f"position {i}"
        best = row.topk(k + 1)
        if k and (best.values[k - 1] - best.values[k]).item() < 10 * TOL:
            continue  # a near-tie at the k-th place: either token may be listed
        want = [actual, *best.indices[:k].tolist()]
        texts = {tok.decode([t]) for t in want}
        if len(texts) < len(set(want)):
            continue  # two tokens that print the same: one key in the JSON object
        # The token itself and the k most likely: up to k + 1 entries, as OpenAI documents.
        top = lp["top_logprobs"][i]
        assert set(top) == texts
        for t in want:
            assert abs(top[tok.decode([t])] - row[t].item()) < TOL
        checked += 1
    assert checked >= len(ids) // 2


def test_echo_with_logprobs_matches_transformers_and_the_plain_completion(server):
    kw = dict(model="tiny-llama", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    plain = server.client.completions.create(**kw).choices[0]
    echo = server.client.completions.create(echo=True, **kw)
    c = echo.choices[0]
    ids = server.tok(PROMPT).input_ids
    assert c.text == PROMPT + plain.text
    lp = c.logprobs.model_dump()
    check_prompt_part(server, ids, lp, k=2)
    # After the prompt: exactly the plain completion's logprobs, its offsets shifted.
    n = len(ids)
    assert lp["tokens"][n:] == plain.logprobs.tokens
    assert lp["token_logprobs"][n:] == plain.logprobs.token_logprobs
    assert lp["top_logprobs"][n:] == plain.logprobs.top_logprobs
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and all(offsets[i + 1] == offsets[i] + len(lp["tokens"][i])
                                   for i in range(len(offsets) - 1))
    assert echo.usage.prompt_tokens == n and echo.usage.completion_tokens == 4
    # vLLM puts the prompt logprobs it computed for echo in the choice as well.
    assert c.model_extra["prompt_logprobs"][0] is None and len(c.model_extra["prompt_logprobs"]) == n


def test_echo_with_max_tokens_zero_returns_the_prompt_alone(server):
    ids = server.tok(PROMPT).input_ids
    body = post(server, "/v1/completions", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    c = body["choices"][0]
    assert c["text"] == PROMPT and len(c["logprobs"]["tokens"]) == len(ids)
    check_prompt_part(server, ids, c["logprobs"], k=1)
    assert body["usage"]["prompt_tokens"] == len(ids)
    err = post(server, "/v1/completions", 400, prompt=PROMPT, max_tokens=0)["error"]
    assert err["param"] == "max_tokens"  # without echo there is nothing to return


def check_prompt_logprobs(server, ids: list[int], entries: list, k: int) -> None:
    """vLLM's prompt_logprobs JSON: null, then {token id: {logprob, rank, decoded_token}}."""
    ref = hf_logprobs(server, ids)
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        row, d = ref[i - 1], entries[i]
        own = d[str(ids[i])]
        assert abs(own["logprob"] - row[ids[i]].item()) < TOL
        assert own["decoded_token"] == server.tok.decode([ids[i]])
        assert (row > row[ids[i]] + TOL).sum() + 1 <= own["rank"] <= (row > row[ids[i]] - TOL).sum() + 1
        ranked = sorted((e["rank"], e["logprob"]) for e in d.values() if e["rank"] <= k)
        assert [r for r, _ in ranked] == list(range(1, k + 1))
        for (_, got), want in zip(ranked, row.topk(k).values.tolist()):
            assert abs(got - want) < TOL


def test_prompt_logprobs_in_completions_and_chat(server):
    ids = server.tok(PROMPT).input_ids
    c = post(server, "/v1/completions", prompt=PROMPT, max_tokens=1, prompt_logprobs=3)["choices"][0]
    check_prompt_logprobs(server, ids, c["prompt_logprobs"], k=3)
    assert c["logprobs"] is None  # prompt_logprobs alone asks for no completion logprobs
    messages = [{"role": "user", "content": "Name three colours."}]
    chat = post(server, "/v1/chat/completions", messages=messages, max_tokens=1, prompt_logprobs=2)
    chat_ids = post(server, "/tokenize", messages=messages)["tokens"]
    assert chat["usage"]["prompt_tokens"] == len(chat_ids)
    check_prompt_logprobs(server, chat_ids, chat["prompt_logprobs"], k=2)  # top level, as vLLM
    plain = post(server, "/v1/completions", prompt=PROMPT, max_tokens=1)["choices"][0]
    assert plain["prompt_logprobs"] is None


@pytest.mark.parametrize("body", [
    {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True},   # vLLM: not with stream
    {"prompt": PROMPT, "prompt_logprobs": 21},                   # beyond MAX_LOGPROBS
    {"prompt": PROMPT, "prompt_logprobs": -1},
])
def test_bad_prompt_logprobs_is_a_400_naming_it(server, body):
    err = post(server, "/v1/completions", 400, **body)["error"]
    assert err["param"] == "prompt_logprobs" and "prompt_logprobs" in err["message"]


def events(server, **body) -> list[dict]:
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_echo_streams_the_prompt_first(server):
    kw = dict(prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, echo=True)
    whole = post(server, "/v1/completions", **kw)["choices"][0]
    chunks = [e["choices"][0] for e in events(server, stream=True, **kw)]
    assert chunks[0]["text"].startswith(PROMPT)
    assert "".join(c["text"] for c in chunks) == whole["text"]
    merged = {key: [x for c in chunks if c["logprobs"] for x in c["logprobs"][key]]
              for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert merged == whole["logprobs"]


def test_batched_token_prompts_with_echo_as_lm_eval_sends_them(server):
    """lm-eval's loglikelihood with --batch_size 2: token-id prompts, echo, logprobs=1."""
    a, b = server.tok(PROMPT).input_ids, server.tok("A short second prompt").input_ids
    body = post(server, "/v1/completions", prompt=[a, b], max_tokens=1, temperature=0, echo=True,
                logprobs=1, seed=1234)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for ids, c in zip((a, b), body["choices"]):
        assert c["text"].startswith(server.tok.decode(ids))
        assert len(c["logprobs"]["tokens"]) == len(ids) + 1
        check_prompt_part(server, ids, c["logprobs"], k=1)
    assert body["usage"]["prompt_tokens"] == len(a) + len(b)
    assert body["usage"]["completion_tokens"] == 2
