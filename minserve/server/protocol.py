"""Request bodies of the OpenAI-compatible API (pydantic) and OpenAI-style errors.

Types are checked here; value ranges are checked where they are defined once for everyone
(``SamplingParams``, the engine's context length, admission), so the server cannot drift from the
engine. The schema lists every field vLLM's completions and chat requests accept; each one is
either implemented as vLLM implements it or refused with a 400 naming it (sampling_fields.py holds
that table, and tests/test_api_request_fields.py walks these models so a new field cannot be
accepted and dropped). Fields outside the schema are ignored, as vLLM does (it logs them), so
clients that send newer OpenAI fields keep working.

Errors use OpenAI's body, which the ``openai`` client turns into typed exceptions::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": null}}

Every bad input is a 4xx naming the field: pydantic's type errors arrive as
``RequestValidationError`` and become 400 (vLLM's choice; FastAPI's default 422 surprises OpenAI
clients), range errors are ``ValueError`` from SamplingParams and also become 400.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict

ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_exceeded",
               500: "internal_server_error", 503: "service_unavailable", 504: "timeout_error"}


class ApiError(Exception):
    """Raised anywhere in a handler; turned into an OpenAI error response."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


_LEADING_FIELD = re.compile(r"([A-Za-z_]\w*(?:\.\w+)*)(?=[ =:\[]|$)")


def value_error(e: ValueError) -> ApiError:
    """A 400 from a ValueError of SamplingParams or the engine's checks: their messages start
    with the field they refuse ("top_p must be ...", "min_tokens=10 is more than ..."), which
    becomes ``param``."""
    message = str(e)
    m = _LEADING_FIELD.match(message)
    return ApiError(400, message, m.group(1) if m else None)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": _utf8(message), "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": None if param is None else _utf8(param), "code": code}}


def _utf8(text: str) -> str:
    """An error that quotes a client's lone surrogate must still encode, or the error response
    itself fails (a 500 and a reset connection); such characters are written as escapes."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param, err.code),
                        status_code=err.status, headers=err.headers)


def validation_error_to_api(exc: RequestValidationError) -> ApiError:
    """Pydantic's error list -> one 400 naming the first offending field (and the others)."""
    parts, first_param = [], None
    for e in exc.errors()[:5]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        param = ".".join(loc) or "body"
        first_param = first_param or param
        if e.get("type") == "json_invalid":
            # FastAPI's loc is ("body", character offset): the param names where parsing stopped.
            where = _position(getattr(exc, "body", None), loc[0]) if loc and loc[0].isdigit() else ""
            parts.append(f"the body is not valid JSON: {e.get('ctx', {}).get('error', 'parse error')}"
                         f"{where}")
            first_param = "body." + loc[0] if where else "body"
        else:
            got = repr(jsonable_encoder(e.get("input"), custom_encoder={bytes: repr}))
            parts.append(f"{param}: {e.get('msg')} (got {got[:60]})")
    return ApiError(400, "; ".join(parts) or "invalid request body", first_param)


def _position(doc, pos: str) -> str:
    """' at line L, column C (character N)' of a JSON parse error, as Python's json reports it."""
    n = int(pos)
    if not isinstance(doc, str):
        return f" at character {n}"
    line = doc.count("\n", 0, n) + 1
    column = n - doc.rfind("\n", 0, n)
    return f" at line {line}, column {column} (character {n})"


def _not_a_boolean(value):
    # JSON's true and false are not numbers, but pydantic's lax mode reads them as 1 and 0: a
    # client sending {"max_tokens": true} or token ids [true, false] has a bug it must be told of.
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got the boolean {str(value).lower()}")
    return value


# Numbers as the request bodies take them: lax as pydantic is ("5" and 5.0 are 5), booleans refused.
Int = Annotated[int, BeforeValidator(_not_a_boolean)]
Float = Annotated[float, BeforeValidator(_not_a_boolean)]
# Items of lists and maps, which may hold a vocabulary's worth: pydantic's strict mode refuses
# booleans (and strings) in its own code, where a Python validator per item would cost ~0.2 us
# each on the event loop. A token id or a bias is a JSON number, never a string.
TokenId = Annotated[int, Strict()]
Bias = Annotated[float, Strict()]


# Lists of objects are bounded in the schema itself: pydantic builds one Python object per item on
# the event loop, so a 4 MiB body of 110 k empty messages froze every stream for ~0.5 s before any
# check of ours could run; with max_length it stops at the first item past the bound, in ~2 ms
# (benchmarks/bench_request_prep.py).
# No conversation that fits a context of tens of thousands of tokens has more messages (a message
# costs a few template tokens even when empty); 128 tools and tool calls is OpenAI's own limit.
MAX_MESSAGES = 4096
MAX_TOOLS = 128
MAX_DOCUMENTS = 1024


def bounded(item, most: int):
    return Annotated[list[item], Field(max_length=most)]


class _Body(BaseModel):
    # protected_namespaces=(): "model" is an OpenAI field name, not pydantic's namespace.
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class _Strict(BaseModel):
    # Nested vLLM objects (structured outputs): a misspelt key is a 400, not a dropped constraint.
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), populate_by_name=True)


class StreamOptions(_Body):
    include_usage: bool | None = True          # vLLM's default once stream_options is sent
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(_Body):
    name: str                          # required, as in OpenAI and vLLM
    description: str | None = None
    # OpenAI calls it "schema", which shadows a pydantic BaseModel attribute.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` request field (its StructuredOutputsParams), one kind set."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None


class _CommonRequest(_Body):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extras, then minserve's."""

    model: str | None = None
    frequency_penalty: Float | None = 0.0
    presence_penalty: Float | None = 0.0
    logit_bias: dict[str, Bias] | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    n: Int = 1
    best_of: Int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: Int | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extra sampling fields
    use_beam_search: bool = False
    length_penalty: Float = 1.0
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    ignore_eos: bool = False
    min_tokens: Int = 0
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: Int | None = None
    truncation_side: Literal["left", "right"] | None = None
    prompt_logprobs: Int | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's extra request fields
    echo: bool = False
    request_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    logits_processors: list[Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: Int | None = None
    # vLLM's prefix-cache isolation and scheduling fields
    cache_salt: str | None = None
    priority: Int = 0
    # minserve: the answer must be complete within this many ms of arrival, or it is shed
    deadline_ms: Float | None = None


class CompletionRequest(_CommonRequest):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: Int | None = 16        # OpenAI's default for /v1/completions
    logprobs: Int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True    # vLLM: BOS etc. as the tokenizer adds them
    prompt_embeds: str | list[str] | None = None
    logprob_token_ids: list[TokenId] | None = None
    # vLLM before 0.12 took structured outputs as these top-level fields
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str = "{}"              # a JSON object, as a string (OpenAI's convention)


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: str
    content: str | bounded(TextPart, MAX_MESSAGES) | None = None
    name: str | None = None
    tool_calls: bounded(ToolCall, MAX_TOOLS) | None = None   # an assistant turn that called tools
    tool_call_id: str | None = None            # a tool turn: which call this answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_CommonRequest):
    messages: bounded(ChatMessage, MAX_MESSAGES)
    max_tokens: Int | None = None      # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    tools: bounded(ChatTool, MAX_TOOLS) | None = None
    # None: vLLM's default, "auto" when tools are given and "none" otherwise
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    include_reasoning: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False   # vLLM: the chat template already adds what it needs
    documents: bounded(dict[str, str], MAX_DOCUMENTS) | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    max_repetition_pattern_size: Int = 0
    min_repetition_pattern_size: Int = 0
    repetition_min_count: Int = 0
