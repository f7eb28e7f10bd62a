"""Every request field of /v1/completions and /v1/chat/completions is implemented or refused.

The test walks the pydantic models themselves: a field added to protocol.py without an entry in
FIELDS below fails ``test_every_field_has_a_case``. Each case sends one non-default value and
checks either a 400 naming the field or the field's documented effect: on the response, on the
prompt the engine got, or on the SamplingParams it got (the sampler's own tests check what those
parameters do to the logits; the behaviour tests at the end check a few end to end).
"""

from __future__ import annotations

import importlib.util
import json
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import pytest

from inprocess_api import recorded_server
from minserve.server.protocol import ChatCompletionRequest, CompletionRequest

HAS_GRAMMAR = importlib.util.find_spec("xgrammar") is not None  # the 'structured' extra
PROMPT = "The quick brown fox"
BASE = {"completion": {"prompt": PROMPT, "max_tokens": 4, "temperature": 0},
        "chat": {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 4,
                 "temperature": 0}}
PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}}]
# Prints the variables vLLM passes to a chat template, so their effect shows in the prompt.
PROBE_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}"
                  "docs={{ documents }} effort={{ reasoning_effort }} flavour={{ flavour }}")


@pytest.fixture(scope="module")
def srv():
    with recorded_server("tiny-llama", max_num_seqs=4, max_num_batched_tokens=256,
                         num_kv_blocks=128) as server:
        yield server


def send(srv, kind: str, **fields):
    srv.seen.clear()
    return srv.client.post(PATHS[kind], json={**BASE[kind], **fields})


def text_of(body: dict) -> str:
    choice = body["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


@contextmanager
def probe_template(tok):
    saved, tok.chat_template = tok.chat_template, PROBE_TEMPLATE
    try:
        yield
    finally:
        tok.chat_template = saved


@dataclass
class Case:
    value: object
    check: Callable                     # check(srv, kind, response)
    extra: dict = field(default_factory=dict)   # other fields the case needs
    template: bool = False              # render with PROBE_TEMPLATE
    grammar: bool = False               # needs the structured-outputs backend (xgrammar)


def refused(name: str) -> Callable:
    def check(srv, kind, r):
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == name, r.json()
    return check


def ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def param(name: str, expected) -> Callable:
    """The field reached SamplingParams as vLLM maps it."""
    def check(srv, kind, r):
        ok(r)
        assert getattr(srv.seen[-1].params, name) == expected
    return check


def prompt_has(fragment: str) -> Callable:
    def check(srv, kind, r):
        ok(r)
        assert fragment in srv.tok.decode(srv.seen[-1].prompt)
    return check


def every_token(token: int) -> Callable:
    def check(srv, kind, r):
        assert text_of(ok(r)) == srv.tok.decode([token] * 4)
    return check


def structured(key: str, expected) -> Callable:
    def check(srv, kind, r):
        ok(r)
        assert getattr(srv.seen[-1].params.structured_outputs, key) == expected
    return check


def check_model(srv, kind, r):
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def check_prompt(srv, kind, r):
    assert ok(r)["usage"]["prompt_tokens"] == len(srv.tok("One two").input_ids)


def check_messages(srv, kind, r):
    ok(r)
    assert "Other words." in srv.tok.decode(srv.seen[-1].prompt)


def check_n(srv, kind, r):
    assert [c["index"] for c in ok(r)["choices"]] == [0, 1]


def check_stream(srv, kind, r):
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.rstrip().endswith("data: [DONE]")


def check_stream_options(srv, kind, r):
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4


def check_max_tokens(srv, kind, r):
    assert ok(r)["usage"]["completion_tokens"] == 2


def check_truncate(srv, kind, r):
    assert ok(r)["usage"]["prompt_tokens"] == 2


def check_truncation_side(srv, kind, r):
    ok(r)
    full = srv.tok(PROMPT).input_ids if kind == "completion" else None
    if full is not None:
        assert srv.seen[-1].prompt == full[:2]
    else:
        assert len(srv.seen[-1].prompt) == 2


def check_prompt_logprobs(srv, kind, r):
    body = ok(r)
    lps = body["choices"][0]["prompt_logprobs"] if kind == "completion" else body["prompt_logprobs"]
    assert lps[0] is None and len(lps) == len(srv.seen[-1].prompt) and lps[1]


def check_echo(srv, kind, r):
    start = PROMPT if kind == "completion" else "The answer is"
    assert text_of(ok(r)).startswith(start)


def check_request_id(srv, kind, r):
    assert ok(r)["id"] == ("cmpl-" if kind == "completion" else "chatcmpl-") + "client-id-7"


def check_logprobs(srv, kind, r):
    lps = ok(r)["choices"][0]["logprobs"]
    if kind == "completion":
        assert len(lps["tokens"]) == 4 and all(len(t) == 2 for t in lps["top_logprobs"])
    else:
        assert len(lps["content"]) == 4


def check_top_logprobs(srv, kind, r):
    assert all(len(e["top_logprobs"]) == 2 for e in ok(r)["choices"][0]["logprobs"]["content"])


def check_cache_salt(srv, kind, r):
    ok(r)
    salted = srv.seen[-1].cache_salt
    ok(send(srv, kind))
    assert salted != srv.seen[-1].cache_salt


def check_add_special_tokens(srv, kind, r):
    ok(r)
    if kind == "completion":
        assert srv.seen[-1].prompt == srv.tok(PROMPT, add_special_tokens=False).input_ids
    else:  # the rendered template, tokenized with the tokenizer's special tokens
        rendered = srv.tok.apply_chat_template(BASE["chat"]["messages"], tokenize=False,
                                               add_generation_prompt=True)
        assert srv.seen[-1].prompt == srv.tok(rendered, add_special_tokens=True).input_ids


def check_generation_prompt(srv, kind, r):
    ok(r)
    assert not srv.tok.decode(srv.seen[-1].prompt).endswith("<|im_start|>assistant\n")


def check_continue(srv, kind, r):
    ok(r)
    assert srv.tok.decode(srv.seen[-1].prompt).endswith("The answer is")


def check_tools(srv, kind, r):
    ok(r)
    prompt = srv.tok.decode(srv.seen[-1].prompt)
    assert "get_weather" in prompt and "<tool_call>" in prompt
    assert srv.seen[-1].params.structured_outputs is None  # "none": not forced


def check_required(srv, kind, r):
    schema = (ok(r), srv.seen[-1].params.structured_outputs.json)[1]
    assert schema["type"] == "array" and schema["minItems"] == 1


def check_parallel(srv, kind, r):
    ok(r)
    assert srv.seen[-1].params.structured_outputs.json["maxItems"] == 1


def check_regex(srv, kind, r):
    assert re.fullmatch(r"[0-9]{3}", text_of(ok(r)))


def check_choice(srv, kind, r):
    assert text_of(ok(r)) in ("yes", "no")


def check_deadline(srv, kind, r):
    ok(r)
    assert srv.seen[-1].deadline_at is not None


def check_priority(srv, kind, r):
    ok(r)
    assert srv.seen[-1].priority == 3  # fcfs: the engine gets the body's priority unchanged


def check_accepted(srv, kind, r):
    ok(r)  # "user": vLLM ignores it; here it keys admission only (tests/test_tenants.py)


def check_max_completion_tokens(srv, kind, r):
    assert ok(r)["usage"]["completion_tokens"] == 2 and srv.seen[-1].params.max_tokens == 2


ASSISTANT_TAIL = {"messages": [{"role": "user", "content": "Finish this."},
                               {"role": "assistant", "content": "The answer is"}],
                  "add_generation_prompt": False}
FIELDS: dict[str, Case] = {
    "model": Case("no-such-model", check_model),
    "prompt": Case("One two", check_prompt),
    "messages": Case([{"role": "user", "content": "Other words."}], check_messages),
    "frequency_penalty": Case(1.5, param("frequency_penalty", 1.5)),
    "presence_penalty": Case(-1.0, param("presence_penalty", -1.0)),
    "repetition_penalty": Case(1.3, param("repetition_penalty", 1.3)),
    "logit_bias": Case({"42": 100}, every_token(42)),
    "temperature": Case(0.7, param("temperature", 0.7)),
    "top_p": Case(0.5, param("top_p", 0.5)),
    "n": Case(2, check_n, {"temperature": 1.0, "seed": 1}),
    "best_of": Case(3, refused("best_of")),
    "stop": Case(["zz"], param("stop", ["zz"])),
    "stream": Case(True, check_stream),
    "stream_options": Case({"include_usage": True}, check_stream_options,
                           {"stream": True, "ignore_eos": True}),
    "seed": Case(7, param("seed", 7)),
    "user": Case("alice", check_accepted),
    "response_format": Case({"type": "json_object"}, structured("json_object", True), grammar=True),
    "use_beam_search": Case(True, refused("use_beam_search")),
    "length_penalty": Case(0.5, refused("length_penalty")),
    "top_k": Case(5, param("top_k", 5)),
    "min_p": Case(0.1, param("min_p", 0.1)),
    "ignore_eos": Case(True, param("ignore_eos", True)),
    "min_tokens": Case(2, param("min_tokens", 2)),
    "stop_token_ids": Case([5], param("stop_token_ids", [5])),
    "skip_special_tokens": Case(False, param("skip_special_tokens", False)),
    "spaces_between_special_tokens": Case(False, refused("spaces_between_special_tokens")),
    "include_stop_str_in_output": Case(True, param("include_stop_str_in_output", True)),
    "truncate_prompt_tokens": Case(2, check_truncate),
    "truncation_side": Case("right", check_truncation_side, {"truncate_prompt_tokens": 2}),
    "prompt_logprobs": Case(1, check_prompt_logprobs),
    "allowed_token_ids": Case([42], every_token(42)),
    "bad_words": Case(["fox"], param("bad_words", ["fox"])),
    "structured_outputs": Case({"choice": ["yes", "no"]}, check_choice, {"max_tokens": 8}, grammar=True),
    "echo": Case(True, check_echo),
    "request_id": Case("client-id-7", check_request_id),
    "return_tokens_as_token_ids": Case(True, refused("return_tokens_as_token_ids")),
    "return_token_ids": Case(True, refused("return_token_ids")),
    "logits_processors": Case(["my.Processor"], refused("logits_processors")),
    "kv_transfer_params": Case({"do_remote_decode": True}, refused("kv_transfer_params")),
    "vllm_xargs": Case({"a": 1}, refused("vllm_xargs")),
    "repetition_detection": Case({"max_pattern_size": 4}, refused("repetition_detection")),
    "thinking_token_budget": Case(10, refused("thinking_token_budget")),
    "cache_salt": Case("tenant-secret", check_cache_salt),
    "priority": Case(3, check_priority),
    "deadline_ms": Case(60000, check_deadline),
    "max_tokens": Case(2, check_max_tokens, {"ignore_eos": True}),
    "logprobs": Case(2, check_logprobs),
    "suffix": Case("the end", refused("suffix")),
    "add_special_tokens": Case(False, check_add_special_tokens),
    "prompt_embeds": Case("AAAA", refused("prompt_embeds")),
    "logprob_token_ids": Case([1], refused("logprob_token_ids")),
    "guided_json": Case({"type": "object"}, structured("json", {"type": "object"}), grammar=True),
    "guided_regex": Case("[0-9]{3}", check_regex, {"max_tokens": 6}, grammar=True),
    "guided_choice": Case(["yes", "no"], check_choice, {"max_tokens": 8}, grammar=True),
    "guided_grammar": Case('root ::= "ab"', structured("grammar", 'root ::= "ab"'), grammar=True),
    "guided_whitespace_pattern": Case(" *", refused("guided_whitespace_pattern")),
    "max_completion_tokens": Case(2, check_max_completion_tokens, {"ignore_eos": True}),
    "top_logprobs": Case(2, check_top_logprobs, {"logprobs": True}),
    "tools": Case(TOOLS, check_tools, {"tool_choice": "none"}),
    "tool_choice": Case("required", check_required, {"tools": TOOLS}, grammar=True),
    "parallel_tool_calls": Case(False, check_parallel, {"tools": TOOLS, "tool_choice": "required"},
                                grammar=True),
    "reasoning_effort": Case("low", prompt_has("effort=low"), template=True),
    "include_reasoning": Case(False, refused("include_reasoning")),
    "add_generation_prompt": Case(False, check_generation_prompt),
    "continue_final_message": Case(True, check_continue, ASSISTANT_TAIL),
    "documents": Case([{"title": "t", "text": "DOCTEXT"}], prompt_has("DOCTEXT"), template=True),
    "chat_template": Case("{{ messages }}", refused("chat_template")),
    "chat_template_kwargs": Case({"flavour": "lemon"}, prompt_has("flavour=lemon"), template=True),
    "mm_processor_kwargs": Case({"size": 1}, refused("mm_processor_kwargs")),
    "max_repetition_pattern_size": Case(4, refused("max_repetition_pattern_size")),
    "min_repetition_pattern_size": Case(2, refused("min_repetition_pattern_size")),
    "repetition_min_count": Case(3, refused("repetition_min_count")),
}
# Where a field means something different per endpoint.
PER_KIND = {
    ("chat", "logprobs"): Case(True, check_logprobs),
    ("chat", "add_special_tokens"): Case(True, check_add_special_tokens),
    ("chat", "echo"): Case(True, check_echo, {"messages": ASSISTANT_TAIL["messages"],
                                              "add_generation_prompt": False,
                                              "continue_final_message": True}),
    ("chat", "truncation_side"): Case("left", check_truncation_side, {"truncate_prompt_tokens": 2}),
}
MODELS = {"completion": CompletionRequest, "chat": ChatCompletionRequest}
ALL = [(kind, name) for kind, model in MODELS.items() for name in model.model_fields]


def test_every_field_has_a_case():
    missing = [f"{kind}.{name}" for kind, name in ALL
               if (kind, name) not in PER_KIND and name not in FIELDS]
    assert not missing, f"request fields without a case (implement or refuse, then add one): {missing}"


@pytest.mark.parametrize("kind,name", ALL, ids=[f"{k}.{n}" for k, n in ALL])
def test_field_is_implemented_or_refused(srv, kind, name):
    case = PER_KIND.get((kind, name)) or FIELDS[name]
    if case.grammar and not HAS_GRAMMAR:
        pytest.skip("structured outputs need xgrammar (pip install 'minserve[structured]')")
    body = {**case.extra, name: case.value}
    if case.template:
        with probe_template(srv.tok):
            r = send(srv, kind, **body)
    else:
        r = send(srv, kind, **body)
    case.check(srv, kind, r)


def test_fields_outside_the_schema_are_ignored(srv):
    # As in vLLM (which logs them): clients that send newer OpenAI fields keep working.
    for kind in PATHS:
        assert send(srv, kind, store=True, metadata={"a": "b"}, web_search_options={}).status_code == 200


def test_refusals_use_vllm_wording(srv):
    r = send(srv, "completion", stream_options={"include_usage": True})
    assert r.json()["error"]["message"] == "Stream options can only be defined when `stream=True`."
    assert send(srv, "completion", suffix="x").json()["error"]["message"] == "suffix is not currently supported"
    r = send(srv, "chat", continue_final_message=True)
    assert r.status_code == 400 and "Cannot set both `continue_final_message`" in r.json()["error"]["message"]
    r = send(srv, "chat", best_of=1, n=2)
    assert r.json()["error"]["message"] == "best_of must be greater than or equal to n, got n=2 and best_of=1."


def test_bad_values_are_400s_naming_the_field(srv):
    cases = [("completion", {"logit_bias": {"99999999": 1}}, "logit_bias"),
             ("completion", {"logit_bias": {"a": 1}}, "logit_bias"),
             ("completion", {"allowed_token_ids": [10 ** 9]}, "allowed_token_ids"),
             ("completion", {"presence_penalty": 3.0}, "presence_penalty"),
             ("completion", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
             ("completion", {"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn"),
             ("completion", {"response_format": {"type": "json_schema"}}, "response_format"),
             ("completion", {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
              "response_format.json_schema.name"),
             ("completion", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
             ("chat", {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
             ("chat", {"tool_choice": "required"}, "tool_choice")]
    for kind, fields, name in cases:
        r = send(srv, kind, **fields)
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (fields, r.text)


def test_logit_bias_and_penalties_change_greedy_output(srv):
    """End to end: a bias makes greedy pick the token; a strong repetition penalty changes a
    greedy output that repeats itself (the random tiny model's margins are large, so only a
    strong penalty is sure to flip its choice)."""
    base = text_of(ok(send(srv, "completion", max_tokens=12, ignore_eos=True)))
    biased = text_of(ok(send(srv, "completion", max_tokens=12, ignore_eos=True,
                             logit_bias={"42": 100})))
    assert biased == srv.tok.decode([42] * 12) != base
    ids = srv.tok(base).input_ids
    if len(set(ids)) < len(ids):  # the model repeats itself: a penalty must change that
        penalized = text_of(ok(send(srv, "completion", max_tokens=12, ignore_eos=True,
                                    repetition_penalty=100.0)))
        assert penalized != base
