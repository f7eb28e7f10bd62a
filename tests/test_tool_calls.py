"""Tool calls: the parsers on strings (whole and streamed), tool_choice rules, and the server with
the default model: "required" and a named function forced through structured outputs, "auto"
parsed from the output (made to be a call with a structured-output choice), vLLM's 400 without
the flags, streaming deltas, and earlier calls rendered back into the prompt."""

from __future__ import annotations

import importlib.util
import json
import pytest
from openai.types.chat import ChatCompletion

from inprocess_api import recorded_server
from minserve.server.cli import main as serve_main
from minserve.server.protocol import ApiError, ChatCompletionRequest
from minserve.server.tool_parsers import TOOL_PARSERS, get_tool_parser
from minserve.server.tool_parsers.plan import AUTO_NEEDS_FLAGS, ToolConfig, plan_tools
from minserve.server.tool_parsers.reply import ChatReply

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}},
    "$defs": {"zone": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
needs_grammar = pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None,
                                   reason="forced tool calls need xgrammar (the 'structured' extra)")
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def streamed(parser, text: str, piece: int = 1) -> tuple[str, list]:
    s = parser.streamer()
    content, calls = "", []
    for i in range(0, len(text), piece):
        c, k = s.feed(text[i:i + piece])
        content, calls = content + c, calls + k
    c, k = s.finish()
    return content + c, calls + k


@pytest.mark.parametrize("text,content,calls", [
    ("Let me check. " + CALL_TEXT, "Let me check. ", [("get_weather", {"city": "Paris"})]),
    (CALL_TEXT + CALL_TEXT.replace("Paris", "Rome"), None,
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
    # SmolLM2's own form: a JSON list in one pair of tags
    ('<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]</tool_call>',
     None, [("a", {}), ("b", {"x": 1})]),
    ('<tool_call>{"name": "a", "arguments": {"x": 2}}', None, [("a", {"x": 2})]),   # never closed
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("Just words, and a < sign.", "Just words, and a < sign.", []),
])
def test_hermes_parser(text, content, calls):
    parser = get_tool_parser("hermes")
    found = parser.extract(text)
    assert found.content == content
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == calls
    for piece in (1, 3, 1000):  # streamed in any split: the same calls, content as it came
        s_content, s_calls = streamed(parser, text, piece)
        assert [(c.name, json.loads(c.arguments)) for c in s_calls] == calls
        assert s_content == (content or "") if calls else s_content == text


@pytest.mark.parametrize("text,calls", [
    ('{"name": "a", "parameters": {"x": 1}}', [("a", {"x": 1})]),
    ('<|python_tag|>{"name": "a", "arguments": {}}; {"name": "b", "arguments": {"y": "z"}}',
     [("a", {}), ("b", {"y": "z"})]),
    ('[{"name": "a", "arguments": {}}]', [("a", {})]),
    ("The answer is 4.", []),
    ('{"name": "a", "arguments": {}} and then some words', []),
])
def test_llama3_json_parser(text, calls):
    parser = get_tool_parser("llama3_json")
    found = parser.extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == calls
    assert found.content == (None if calls else text)
    s_content, s_calls = streamed(parser, text, 2)
    assert [c.name for c in s_calls] == [c[0] for c in calls] and s_content == ("" if calls else text)


def _plan(config=None, **body):
    return plan_tools(ChatCompletionRequest(messages=ASK, **body), config)


def test_tool_choice_rules():
    assert _plan() is None and _plan(tools=[WEATHER], tool_choice="none").mode == "none"
    with pytest.raises(ApiError, match="requires --enable-auto-tool-choice"):
        _plan(tools=[WEATHER])  # tools without tool_choice mean "auto"
    assert _plan(ToolConfig(True, "hermes"), tools=[WEATHER]).mode == "auto"
    with pytest.raises(ApiError, match="`tools` must be set"):
        _plan(tool_choice="required")
    with pytest.raises(ApiError, match="does not match any of the specified `tools`"):
        _plan(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert _plan(tools=[], tool_choice="required") is None  # OpenAI: behaves as "none"
    named = _plan(tools=[WEATHER, TIME],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.schema == WEATHER["function"]["parameters"]
    required = _plan(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert required.schema["maxItems"] == 1 and required.schema["$defs"] == {"zone": {"type": "string"}}
    names = [v["properties"]["name"]["enum"] for v in required.schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    with pytest.raises(ValueError, match="--tool-call-parser must be one of"):
        ToolConfig(True, "no-such-parser")
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json"}


def test_reply_messages_and_finish_reasons():
    auto = ChatReply(_plan(ToolConfig(True, "hermes"), tools=[WEATHER]))
    msg, finish = auto.message("Sure. " + CALL_TEXT, "stop")
    assert msg["content"] == "Sure. " and finish == "tool_calls"
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    plain = {"role": "assistant", "content": "No tools needed."}
    assert auto.message("No tools needed.", "stop") == (plain, "stop")
    one = ChatReply(_plan(ToolConfig(True, "hermes"), tools=[WEATHER], parallel_tool_calls=False))
    assert len(one.message(CALL_TEXT * 2, "stop")[0]["tool_calls"]) == 1
    required = ChatReply(_plan(tools=[WEATHER], tool_choice="required"))
    msg, finish = required.message('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]', "stop")
    assert finish == "tool_calls" and msg["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert required.message('[{"name": "get_wea', "length") == (
        {"role": "assistant", "content": '[{"name": "get_wea'}, "length")  # cut short: plain text
    echo = ChatReply(None, echo_prefix="The answer is")
    assert echo.message(" 4.", "stop")[0]["content"] == "The answer is 4."


def test_reply_streams():
    """Per-choice streams: echo first, a named call's arguments as they come, "required" and
    "auto" calls once they parse, with the whole form's finish reasons."""
    echo = ChatReply(None, echo_prefix="The answer is").streamer()
    assert echo.delta(" 4", None) == ({"content": "The answer is 4"}, None)
    assert echo.delta(".", "stop") == ({"content": "."}, "stop")
    by_name = {"type": "function", "function": {"name": "get_weather"}}
    named = ChatReply(_plan(tools=[WEATHER], tool_choice=by_name)).streamer()
    first, _ = named.delta('{"city": ', None)
    later, finish = named.delta('"Oslo"}', "stop")
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": '}
    assert later == {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}
    assert finish == "stop"
    required = ChatReply(_plan(tools=[WEATHER], tool_choice="required")).streamer()
    assert required.delta('[{"name": "get_weather", ', None) == ({}, None)
    delta, finish = required.delta('"parameters": {"city": "Oslo"}}]', "stop")
    assert finish == "tool_calls" and delta["tool_calls"][0]["function"]["name"] == "get_weather"
    auto = ChatReply(_plan(ToolConfig(True, "hermes"), tools=[WEATHER])).streamer()
    pieces = [auto.delta(CALL_TEXT[i:i + 7], None) for i in range(0, len(CALL_TEXT), 7)]
    last, finish = auto.delta("", "stop")
    calls = [c for d, _ in [*pieces, (last, finish)] for c in d.get("tool_calls", [])]
    assert finish == "tool_calls" and [c["index"] for c in calls] == [0]
    assert not any("content" in d for d, _ in pieces)


def test_cli_flags():
    assert serve_main(["--enable-auto-tool-choice"]) == 2  # vLLM: the flag needs a parser
    with pytest.raises(SystemExit):
        serve_main(["--tool-call-parser", "no-such-parser"])


# ---- the server, with the default model --------------------------------------------------------

@pytest.fixture(scope="module")
def srv():
    with recorded_server("smollm2-135m", tools=ToolConfig(enable_auto_tool_choice=True,
                                                           tool_call_parser="hermes"),
                         max_num_seqs=4, max_num_batched_tokens=512, num_kv_blocks=128) as server:
        yield server


def chat(srv, **fields):
    return srv.client.post("/v1/chat/completions", json={
        "messages": ASK, "tools": [WEATHER], "temperature": 0, "max_tokens": 40, **fields})


def stream_events(r) -> list[dict]:
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def assembled_calls(events) -> tuple[list[dict], str | None]:
    """Tool-call deltas joined by index (as the openai client does), and the finish reason."""
    calls: dict[int, dict] = {}
    finish = None
    for e in events:
        for choice in e["choices"]:
            finish = choice["finish_reason"] or finish
            for d in choice["delta"].get("tool_calls", []):
                call = calls.setdefault(d["index"], {"name": "", "arguments": ""})
                call["name"] += d.get("function", {}).get("name", "")
                call["arguments"] += d.get("function", {}).get("arguments", "")
    return [calls[i] for i in sorted(calls)], finish


@needs_grammar
def test_required_tool_call_is_valid(srv):
    r = chat(srv, tool_choice="required", parallel_tool_calls=False)
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["finish_reason"] == "tool_calls", r.text
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    parsed = ChatCompletion.model_validate(r.json())  # what the openai client makes of it
    assert parsed.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert call["function"]["name"] == "get_weather"
    assert isinstance(json.loads(call["function"]["arguments"])["city"], str)


@needs_grammar
def test_named_tool_call_streamed_and_whole(srv):
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = chat(srv, tool_choice=named).json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and choice["finish_reason"] == "stop"
    args = json.loads(call["function"]["arguments"])
    calls, finish = assembled_calls(stream_events(chat(srv, tool_choice=named, stream=True)))
    assert calls == [{"name": "get_weather", "arguments": call["function"]["arguments"]}]
    assert json.loads(calls[0]["arguments"]) == args and finish == "stop"


@needs_grammar
def test_auto_parses_the_output(srv):
    # The small model seldom calls tools on its own: a structured-output choice makes its output
    # a call in the hermes format, which the server's parser must turn into tool_calls.
    forced = {"structured_outputs": {"choice": ["I will look. " + CALL_TEXT]}}
    body = chat(srv, **forced).json()
    msg, finish = body["choices"][0]["message"], body["choices"][0]["finish_reason"]
    assert finish == "tool_calls" and msg["content"] == "I will look. "
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] \
        == [("get_weather", {"city": "Paris"})]
    events = stream_events(chat(srv, stream=True, **forced))
    calls, finish = assembled_calls(events)
    content = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert finish == "tool_calls" and content == "I will look. "
    plain = chat(srv, tool_choice="none", **forced).json()["choices"][0]
    assert "tool_calls" not in plain["message"] and plain["message"]["content"].endswith("</tool_call>")


def test_auto_without_flags_is_vllms_400(srv):
    saved, srv.st.tools = srv.st.tools, None
    try:
        r = chat(srv)
    finally:
        srv.st.tools = saved
    assert r.status_code == 400 and r.json()["error"]["message"] == AUTO_NEEDS_FLAGS


def test_earlier_calls_and_results_reach_the_prompt(srv):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "18 C and sunny"}]
    r = chat(srv, messages=history, tool_choice="none", max_tokens=5)
    assert r.status_code == 200, r.text
    prompt = srv.tok.decode(srv.seen[-1].prompt)
    assert "<tools>" in prompt and '"get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in prompt
