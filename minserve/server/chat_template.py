"""A chat request's messages -> prompt token ids, through the model's chat template (vLLM's way).

The template gets what vLLM passes it: ``add_generation_prompt``, ``continue_final_message`` (the
last message is left open so the model continues it), ``tools``, ``documents``,
``reasoning_effort`` and the request's ``chat_template_kwargs`` (which cannot override those
fields or the renderer's own arguments). The rendered text is then tokenized with
``add_special_tokens`` (default false: the template already wrote what the model needs).

Tools: a template that reads ``tools`` renders them itself. SmolLM2-135M-Instruct's template has
no tools section, so for such templates the tools are described in a system message, with the
call format of the server's tool parser (hermes ``<tool_call>`` tags unless another parser is
configured), and earlier tool calls and results are written into the messages in that format.
"""

from __future__ import annotations

import json

from minserve.server.protocol import ApiError, ChatCompletionRequest
from minserve.server.tool_parsers import DEFAULT_TOOL_PARSER, get_tool_parser
from minserve.server.tool_parsers.plan import ToolPlan

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# apply_chat_template's own arguments: not template variables, so not settable by a client.
RESERVED_KWARGS = {"conversation", "tools", "documents", "chat_template", "tokenize", "padding",
                   "truncation", "max_length", "return_tensors", "return_dict",
                   "return_assistant_tokens_mask", "tokenizer_kwargs", "add_generation_prompt",
                   "continue_final_message"}


def chat_prompt_ids(body: ChatCompletionRequest, tokenizer, plan: ToolPlan | None = None) -> list[int]:
    """The prompt of ``body.messages`` (ApiError 400 naming the field for what cannot render)."""
    _check_roles(body)
    native_tools = "tools" in (getattr(tokenizer, "chat_template", None) or "")
    conversation = [_message_dict(m, native_tools) for m in body.messages]
    kwargs = template_kwargs(body)
    if plan is not None:
        if native_tools:
            kwargs["tools"] = plan.tools
        else:
            conversation = _with_tool_prompt(conversation, plan)
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
    except Exception as e:  # a template that rejects this conversation (e.g. role order)
        raise ApiError(400, f"messages could not be rendered with the chat template: {e}",
                       "messages") from None
    add_special = bool(getattr(body, "add_special_tokens", False))
    ids = list(tokenizer(text, add_special_tokens=add_special).input_ids)
    if not ids:
        raise ApiError(400, "messages rendered to an empty prompt", "messages")
    return ids


def template_kwargs(body) -> dict:
    """The template's variables. ``body`` may also be another request with messages (/tokenize's):
    a field it lacks has its chat default."""
    extra = getattr(body, "chat_template_kwargs", None) or {}
    reserved = sorted(RESERVED_KWARGS & extra.keys())
    if reserved:
        raise ApiError(400, f"chat_template_kwargs may not set {reserved}: they are request fields "
                       "or arguments of the renderer", "chat_template_kwargs")
    kwargs = {**extra, "add_generation_prompt": body.add_generation_prompt,
              "continue_final_message": getattr(body, "continue_final_message", False)}
    for name in ("documents", "reasoning_effort"):
        if getattr(body, name, None) is not None:
            kwargs[name] = getattr(body, name)
    return kwargs


def echo_prefix(body: ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the reply starts with the last message if it is the assistant's."""
    if not body.echo or not body.messages or body.messages[-1].role != "assistant":
        return ""
    return body.messages[-1].text()


def _check_roles(body: ChatCompletionRequest) -> None:
    if not body.messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    for i, m in enumerate(body.messages):
        if m.role not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {m.role!r}",
                           f"messages.{i}.role")


def _message_dict(m, native_tools: bool) -> dict:
    out = {"role": m.role, "content": m.text()}
    if native_tools:
        if m.tool_calls:  # templates read the arguments as a mapping (vLLM parses them too)
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                for c in m.tool_calls]
        if m.tool_call_id is not None:
            out["tool_call_id"] = m.tool_call_id
        return out
    if m.tool_calls:
        calls = "\n".join(
            "<tool_call>\n" + json.dumps({"name": c.function.name,
                                          "arguments": _arguments(c.function.arguments)})
            + "\n</tool_call>" for c in m.tool_calls)
        out["content"] = f"{out['content']}\n{calls}" if out["content"] else calls
    if m.role == "tool":
        out["content"] = f"<tool_response>\n{out['content']}\n</tool_response>"
    return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        raise ApiError(400, f"tool_calls arguments must be a JSON object, got {text[:60]!r}",
                       "messages") from None


def _with_tool_prompt(conversation: list[dict], plan: ToolPlan) -> list[dict]:
    """The tools as a system message, for templates that do not render ``tools``."""
    parser = plan.parser or get_tool_parser(DEFAULT_TOOL_PARSER)
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in plan.tools)
    text = ("You can call functions to help with the user's request. They are listed here, one "
            f"JSON description per line, between <tools> and </tools>:\n<tools>\n{listing}\n</tools>\n"
            f"{parser.instructions}")
    if conversation and conversation[0]["role"] in ("system", "developer"):
        first = conversation[0]
        return [{**first, "content": f"{first['content']}\n\n{text}"}, *conversation[1:]]
    return [{"role": "system", "content": text}, *conversation]
