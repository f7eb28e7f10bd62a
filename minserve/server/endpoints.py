"""The server's small endpoints, shaped as vLLM's: tokenizer access, version, model cards.

- ``POST /tokenize``: ``{"prompt": str}`` or ``{"messages": [...]}`` (rendered with the chat
  template), with ``add_special_tokens`` (default true for a prompt, false for messages: the
  template already holds them) and ``return_token_strs``; answers
  ``{"count", "max_model_len", "tokens", "token_strs"}``.
- ``POST /detokenize``: ``{"tokens": [...]}`` -> ``{"prompt": str}``.
- ``GET /tokenizer_info``: the tokenizer's configuration (vLLM's): special tokens, chat template.
  lm-eval's ``local-completions`` looks for it and then tokenizes through ``/tokenize``, so it
  needs no tokenizer of its own (nor the Hugging Face hub).
- ``GET /version``: ``{"version": ...}``; ``GET /v1/models/{id}``: the card, or a 404.
- ``POST /reset_prefix_cache`` (vLLM's, there only in its dev mode): forget every cached prefix
  block, so the next run starts cold (``minserve bench sweep`` calls it between runs). 200
  ``{"reset": true}``; 409 while requests are in flight (blocks in use cannot be forgotten). With
  API keys configured it needs an admin key (auth.py): a cold cache is felt by every tenant.

Every GET route answers HEAD as well (status and headers, no body), as load balancers probe.
Tokenizing is blocking work: it runs on the prepare pool, off the event loop, like prompts do.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

import minserve
from minserve.server.protocol import (MAX_MESSAGES, ApiError, ChatMessage, TokenId, _Body, bounded,
                                      error_body)
from minserve.server.async_engine import reset_prefix_cache
from minserve.server.chat_template import chat_prompt_ids
from minserve.server.limits import check_strings


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: bounded(ChatMessage, MAX_MESSAGES) | None = None
    add_special_tokens: bool | None = None   # None: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


def get_and_head(app: FastAPI, path: str):
    """Register a GET route that answers HEAD too. One route serves both, so a 405 names both in
    its ``Allow`` header (two routes made it say only ``HEAD``); a second, never-reached GET
    route documents it, since one route with two methods would be two operations sharing one id."""
    def register(fn):
        app.api_route(path, methods=["GET", "HEAD"], include_in_schema=False)(fn)
        return app.get(path)(fn)
    return register


def model_card(st) -> dict:
    return {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "minserve",
            "root": st.engine.config.model, "parent": None, "max_model_len": st.engine.max_model_len}


def _check_model(st, model: str | None) -> None:
    if model is not None and model != st.model_name:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                       f"`{st.model_name}` (see /v1/models)", "model", "model_not_found")


def tokenize(st, body: TokenizeRequest) -> dict:
    """The body's prompt or messages as token ids (blocking: run it off the event loop)."""
    check_strings(body)  # a lone surrogate would fail inside the tokenizer: a 400 naming it now
    _check_model(st, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "send exactly one of prompt (a string) or messages (a chat)", "prompt")
    tok = st.engine.tokenizer
    cap = st.limits.prompt_chars(st.engine.max_model_len)
    if body.prompt is not None:
        if len(body.prompt) > cap:
            raise ApiError(400, f"prompt holds {len(body.prompt)} characters; at most {cap}", "prompt")
        ids = list(tok(body.prompt, add_special_tokens=body.add_special_tokens is not False).input_ids)
    else:
        if sum(len(m.text()) for m in body.messages) > cap:
            raise ApiError(400, f"messages hold more than {cap} characters", "messages")
        ids = chat_prompt_ids(body, tok)  # reads add_special_tokens (None: false) itself
    strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": st.engine.max_model_len, "tokens": ids,
            "token_strs": strs}


def detokenize(st, body: DetokenizeRequest) -> dict:
    _check_model(st, body.model)
    vocab = st.engine.model_config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"tokens must be ints in [0, {vocab}), got {bad[:5]}", "tokens")
    return {"prompt": st.engine.tokenizer.decode(body.tokens)}


def tokenizer_info(tokenizer) -> dict:
    """vLLM's /tokenizer_info: the tokenizer's init arguments (file paths left out) made JSON,
    its class and chat template."""
    config = {k: _json_safe(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
              if k not in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        config[name] = getattr(tokenizer, name, None)
    config["tokenizer_class"] = type(tokenizer).__name__
    if getattr(tokenizer, "chat_template", None):
        config["chat_template"] = tokenizer.chat_template
    return config


def _json_safe(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return getattr(value, "content", None) or str(value)  # AddedToken -> its text


async def _off_loop(st, fn, *args):
    return await asyncio.get_running_loop().run_in_executor(st.prepare_pool, fn, st, *args)


def add_routes(app: FastAPI) -> None:
    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest, request: Request):
        return await _off_loop(request.app.state.minserve, tokenize, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest, request: Request):
        return await _off_loop(request.app.state.minserve, detokenize, body)

    @get_and_head(app, "/tokenizer_info")
    async def tokenizer_info_route(request: Request):
        return tokenizer_info(request.app.state.minserve.engine.tokenizer)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache_route(request: Request):
        st = request.app.state.minserve
        try:
            done = await asyncio.wrap_future(st.async_engine.call(reset_prefix_cache))
        except RuntimeError as e:  # the engine loop is not running
            return JSONResponse(error_body(503, str(e)), status_code=503)
        if not done:
            return JSONResponse(error_body(409, "the prefix cache was not reset: requests are still "
                                           "in flight; retry when they have finished",
                                           code="requests_in_flight"), status_code=409)
        return {"reset": True}

    @get_and_head(app, "/version")
    async def version():
        return {"version": minserve.__version__}

    @get_and_head(app, "/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        st = request.app.state.minserve
        if model_id != st.model_name:
            return JSONResponse(error_body(404, f"The model `{model_id}` does not exist; this server "
                                           f"serves `{st.model_name}`", "model", "model_not_found"),
                                status_code=404)
        return model_card(st)
