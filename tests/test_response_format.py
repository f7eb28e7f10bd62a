"""OpenAI's ``response_format`` and vLLM's ``structured_outputs`` over HTTP, with the default model:
json_schema outputs parse and validate (chat and completions, whole and streamed), json_object
outputs are JSON objects, "text" constrains nothing, and a regex or choice holds exactly."""

from __future__ import annotations

import json
import re
import pytest

from inprocess_api import recorded_server

pytest.importorskip("xgrammar", reason="structured outputs need the 'structured' extra (xgrammar)")
jsonschema = pytest.importorskip("jsonschema")  # comes with nbformat (dev extra)

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                         "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}}}
ASKS = ["Describe a person as JSON.", "Invent a character for a story.", "Who is your best friend?",
        "Give me the details of a customer.", "Tell me about a famous painter."]


@pytest.fixture(scope="module")
def srv():
    with recorded_server("smollm2-135m", max_num_seqs=8, max_num_batched_tokens=512,
                         num_kv_blocks=256) as server:
        yield server


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def chat(srv, ask: str, **fields):
    r = srv.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": ask}], "temperature": 0, "max_tokens": 60, **fields})
    assert r.status_code == 200, r.text
    return r


# JSON allows whitespace anywhere between tokens, and a 135M model given that freedom can emit
# newlines until max_tokens (as it would under vLLM). vLLM's structured_outputs option
# disable_any_whitespace, sent beside response_format, takes it away.
COMPACT = {"disable_any_whitespace": True}


@pytest.mark.parametrize("ask", ASKS)
def test_json_schema_outputs_validate(srv, ask):
    choice = chat(srv, ask, response_format=schema_format(PERSON),
                  structured_outputs=COMPACT).json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def test_json_schema_with_any_whitespace(srv):
    choice = chat(srv, ASKS[0], response_format=schema_format(PERSON)).json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def test_json_schema_streamed_and_on_completions(srv):
    r = chat(srv, ASKS[2], response_format=schema_format(PERSON), structured_outputs=COMPACT,
             stream=True)
    text = "".join(c["delta"].get("content") or "" for line in r.text.splitlines()
                   if line.startswith("data: {") for c in json.loads(line[6:])["choices"])
    jsonschema.validate(json.loads(text), PERSON)
    r = srv.client.post("/v1/completions", json={
        "prompt": "A person, as JSON:", "max_tokens": 60, "temperature": 0,
        "response_format": schema_format(PERSON), "structured_outputs": COMPACT})
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), PERSON)


def test_json_object_and_text(srv):
    content = chat(srv, ASKS[1], response_format={"type": "json_object"}, structured_outputs=COMPACT,
                   max_tokens=80).json()["choices"][0]["message"]["content"]
    assert isinstance(json.loads(content), dict)
    chat(srv, ASKS[1], response_format={"type": "text"}, max_tokens=3)
    assert srv.seen[-1].params.structured_outputs is None  # "text" is OpenAI's default: no constraint


def test_regex_and_choice(srv):
    digits = chat(srv, "What year is it?", structured_outputs={"regex": "(19|20)[0-9]{2}"})
    assert re.fullmatch(r"(19|20)[0-9]{2}", digits.json()["choices"][0]["message"]["content"])
    picked = chat(srv, "Is the sky blue?", structured_outputs={"choice": ["yes", "no"]})
    assert picked.json()["choices"][0]["message"]["content"] in ("yes", "no")


def test_response_format_replaces_structured_outputs_constraint(srv):
    # vLLM: response_format's constraint replaces the one in structured_outputs, whose other
    # options (here disable_any_whitespace) still apply.
    content = chat(srv, ASKS[0], response_format=schema_format(PERSON),
                   structured_outputs={"choice": ["x"], "disable_any_whitespace": True}
                   ).json()["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(content), PERSON)
    assert srv.seen[-1].params.structured_outputs.disable_any_whitespace and "\n" not in content
