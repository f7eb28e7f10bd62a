"""Request bodies of the OpenAI-compatible API (pydantic) and OpenAI-style errors.

Types are checked here; value ranges are checked where they are defined once for everyone
(``SamplingParams``, the engine's context length, admission), so the server cannot drift from the
engine. Unknown fields are ignored, as vLLM does, so clients that send newer OpenAI fields work.

Errors use OpenAI's body, which the ``openai`` client turns into typed exceptions::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": null}}

Every bad input is a 4xx naming the field: pydantic's type errors arrive as
``RequestValidationError`` and become 400 (vLLM's choice; FastAPI's default 422 surprises OpenAI
clients), range errors are ``ValueError`` from SamplingParams and also become 400.
"""

from __future__ import annotations

from typing import Literal

from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

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


class _Body(BaseModel):
    # protected_namespaces=(): "model" is an OpenAI field name, not pydantic's namespace.
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class StreamOptions(_Body):
    include_usage: bool = False


class _CommonRequest(_Body):
    """Fields shared by completions and chat (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's prefix-cache isolation and scheduling fields
    cache_salt: str | None = None
    priority: int = 0
    # minserve: the answer must be complete within this many ms of arrival, or it is shed
    deadline_ms: float | None = None


class CompletionRequest(_CommonRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16        # OpenAI's default for /v1/completions
    logprobs: int | None = None
    echo: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None      # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
