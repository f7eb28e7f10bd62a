"""The OpenAPI document at ``/openapi.json``, made to say what the server answers.

FastAPI documents a 422 "Validation Error" with its own ``HTTPValidationError`` body on every route
that takes a body, but this server answers a bad body with 400 and OpenAI's error object (vLLM's
choice; protocol.py). A client generated from the spec, or a schema fuzzer checking responses
against it, would be told the wrong status and the wrong shape. So the document is rewritten once:
each 422 is dropped, and the error statuses each route really answers (400 with the field named,
401 without a valid key when keys are configured, 404 for another model, 413 body too large, 429
shed by admission, 503 draining or engine down, 504 deadline passed) are listed with OpenAI's error
body as ``ErrorResponse``.

The document is public, as in vLLM: with API keys configured, ``/openapi.json`` and ``/docs``
still need no key (auth.py). They describe the API every client sees, the same for every caller,
and say nothing of any tenant, request or load.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA = {
    "title": "ErrorResponse",
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
ERRORS = {
    "400": "Invalid request: the message names the field (`param`) and the allowed range",
    "401": "API keys are configured and the request carries no valid one",
    "403": "/metrics (--metrics-require-admin, the default with keys) and /reset_prefix_cache "
           "need an admin key",
    "404": "The model is not the one this server serves",
    "409": "Requests are in flight: the prefix cache can be reset only when the engine is idle",
    "413": "The body is larger than --max-request-body-bytes",
    "429": "Shed by admission (queue full, tenant quota, deadline predicted to be missed)",
    "503": "Draining, or the engine is not running",
    "504": "The deadline (x-deadline-ms / deadline_ms) passed before the answer was complete",
}
_GENERATE = ("400", "401", "404", "413", "429", "503", "504")
ROUTE_ERRORS = {
    ("/v1/completions", "post"): _GENERATE,
    ("/v1/chat/completions", "post"): _GENERATE,
    ("/tokenize", "post"): ("400", "401", "404", "413"),
    ("/detokenize", "post"): ("400", "401", "404", "413"),
    ("/v1/models/{model_id}", "get"): ("401", "404"),
    ("/v1/models", "get"): ("401",),
    ("/tokenizer_info", "get"): ("401",),
    ("/health", "get"): ("503",),
    ("/metrics", "get"): ("401", "403"),
    ("/reset_prefix_cache", "post"): ("401", "403", "409", "503"),
}


# Routes whose success is not JSON: FastAPI documents every 200 as application/json.
PLAIN_SUCCESS = {
    ("/health", "get"): {"description": "Healthy: an empty body"},
    ("/metrics", "get"): {"description": "Prometheus text exposition (vLLM's metric names)",
                          "content": {"text/plain": {"schema": {"type": "string"}}}},
}


def _error_response(description: str) -> dict:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def server_openapi(app: FastAPI) -> dict:
    """The corrected document (built on first use, then cached on the app, as FastAPI does)."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        schemas["ErrorResponse"] = ERROR_SCHEMA
        for path, ops in doc.get("paths", {}).items():
            for method, op in ops.items():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)  # never answered: a bad body is a 400
                if (path, method) in PLAIN_SUCCESS:
                    responses["200"] = PLAIN_SUCCESS[(path, method)]
                if ROUTE_ERRORS.get((path, method)) is _GENERATE:  # "stream": true answers SSE
                    responses["200"].setdefault("content", {})["text/event-stream"] = {
                        "schema": {"type": "string", "description": "data: <chunk JSON> lines, "
                                   "then data: [DONE]"}}
                for status in ROUTE_ERRORS.get((path, method), ()):
                    responses.setdefault(status, _error_response(ERRORS[status]))
        app.openapi_schema = doc
    return app.openapi_schema


def install(app: FastAPI) -> None:
    app.openapi = lambda: server_openapi(app)
