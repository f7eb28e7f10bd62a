"""The tool side of one chat request, as vLLM does it.

``tool_choice`` (default "auto" when ``tools`` are given, "none" otherwise):
- "none": tools are shown to the model (the template renders them) but its output is plain content.
- "auto": the model decides; its output is parsed by the server's ``--tool-call-parser``, which
  needs ``--enable-auto-tool-choice`` (vLLM's 400 otherwise).
- "required": the output is forced, through structured outputs, to a JSON list of
  ``{"name", "parameters"}`` objects over the given tools; each becomes a tool call.
- a named function: the output is forced to that function's ``parameters`` schema and becomes
  its arguments.
``parallel_tool_calls=false`` keeps one call (the first; "required" then allows only one).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from minserve.server.protocol import ApiError, NamedToolChoice
from minserve.server.tool_parsers import ParsedCall, ToolParser, get_tool_parser

AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                    "--tool-call-parser to be set")
EMPTY_OBJECT = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolConfig:
    """The server's tool flags (``minserve serve --enable-auto-tool-choice --tool-call-parser``)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # an unknown name fails at start-up
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")

    def parser(self) -> ToolParser | None:
        if not (self.enable_auto_tool_choice and self.tool_call_parser):
            return None
        return get_tool_parser(self.tool_call_parser)


@dataclass
class ToolPlan:
    mode: str                          # "none" | "auto" | "required" | "named"
    tools: list[dict]                  # the request's tools, as plain dicts
    parser: ToolParser | None = None   # "auto" only
    function: str | None = None        # "named" only
    parallel: bool = True
    schema: dict | None = field(default=None, repr=False)  # what structured outputs enforce


def plan_tools(body, config: ToolConfig | None) -> ToolPlan | None:
    """The request's ToolPlan, or None without tools; vLLM's 400s for inconsistent choices."""
    choice, tools = body.tool_choice, body.tools
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and tools is None:
        raise ApiError(400, "When using `tool_choice`, `tools` must be set.", "tool_choice")
    if not tools:  # OpenAI: "required" with an empty list behaves as "none"
        return None
    as_dicts = [t.model_dump(exclude_none=True) for t in tools]
    parallel = body.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan("none", as_dicts, parallel=parallel)
    if choice == "auto":
        parser = (config or ToolConfig()).parser()
        if parser is None:
            raise ApiError(400, AUTO_NEEDS_FLAGS, "tool_choice")
        return ToolPlan("auto", as_dicts, parser=parser, parallel=parallel)
    if choice == "required":
        return ToolPlan("required", as_dicts, parallel=parallel,
                        schema=required_schema(tools, parallel))
    assert isinstance(choice, NamedToolChoice)
    by_name = {t.function.name: t.function for t in tools}
    if choice.function.name not in by_name:
        raise ApiError(400, "The tool specified in `tool_choice` does not match any of the "
                       "specified `tools`", "tool_choice")
    fn = by_name[choice.function.name]
    return ToolPlan("named", as_dicts, function=fn.name, parallel=parallel,
                    schema=fn.parameters or EMPTY_OBJECT)


def required_schema(tools, parallel: bool) -> dict:
    """A JSON list of one or more calls, each ``{"name": <one tool>, "parameters": <its
    schema>}`` (vLLM's shape); shared ``$defs`` of the tools are lifted to the top."""
    defs: dict = {}
    variants = []
    for t in tools:
        params = dict(t.function.parameters or EMPTY_OBJECT)
        for name, schema in params.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise ApiError(400, f"Tool definition '{name}' has multiple schemas, which is not "
                               "supported.", "tools")
        variants.append({"properties": {"name": {"type": "string", "enum": [t.function.name]},
                                        "parameters": params},
                         "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def call_json(call: ParsedCall, index: int | None = None) -> dict:
    """One OpenAI ``tool_calls`` entry (with ``index`` in a stream delta)."""
    out = {"id": new_call_id(), "type": "function",
           "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


def calls_of_required(text: str) -> list[ParsedCall] | None:
    """The calls of a "required" output (a JSON list of {name, parameters}); None if it is not
    one, e.g. cut short by max_tokens."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not all(
            isinstance(i, dict) and isinstance(i.get("name"), str) for i in items):
        return None
    return [ParsedCall(i["name"], json.dumps(i.get("parameters") or {}, ensure_ascii=False))
            for i in items]
