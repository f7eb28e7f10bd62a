"""Limits at the door: what a request may weigh before the server spends work on it.

The engine's budget is counted in tokens, but tokens cost CPU to count: tokenization runs at
about 1.3 s per MB of text here, so a huge body could buy seconds of work before any token limit
is checked. Hence a ladder of cheap checks, each before the next costlier step:

1. the body size in bytes (:class:`BodyLimitMiddleware`, from ``Content-Length`` and again while
   the body streams in) -> 413, before JSON parsing; a body that is not UTF-8 -> 400 naming the
   byte, since JSON exchanged between systems must be UTF-8 (RFC 8259);
2. the prompt length in characters (:meth:`RequestLimits.prompt_chars`), the number and length
   of stop strings (:func:`check_sizes`) and of every other list (:func:`check_lists`: token ids,
   logit_bias, bad words, choices, tools) -> 400, before tokenization;
3. every string being valid Unicode (:func:`check_strings`) -> 400 naming the field: a lone
   surrogate (JSON's ``"\\ud800"``) has no UTF-8 form, so it would fail later inside the tokenizer,
   the prefix-cache hash or a response, far from the request that brought it;
4. only then tokenization (off the event loop, app.py), and the token limits of serving.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from minserve.engine.inputs import check_text
from minserve.server.protocol import ApiError, error_response

# A prompt that fits the context holds at most max_model_len tokens, and a token is a few
# characters: ~4 in English text, ~7 on average over SmolLM2's vocabulary, 81 for its longest
# (a run of '#'). 32 per token over the whole context is far above any real text, and keeps the
# worst tokenization at max_model_len * 32 characters (8192 tokens: 256 Ki chars, ~0.3 s here).
CHARS_PER_TOKEN_BOUND = 32


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds checked before tokenization (docs/serving/request-fields.md).

    Stop strings are checked against the new text after every token, so their number and length
    multiply the per-token cost of a request for everyone sharing its batch (100 k of them slowed
    another stream tenfold). OpenAI allows 4; 64 of at most 256 characters leaves room for
    experiments."""

    max_body_bytes: int = 4 * 1024 * 1024
    max_prompt_chars: int | None = None   # None: max_model_len * CHARS_PER_TOKEN_BOUND
    max_stop_strings: int = 64
    max_stop_chars: int = 256
    # The other lists a body may carry (check_lists). Token-id lists and logit_bias may name each
    # token of the vocabulary once (a full-vocabulary allowed_token_ids is a real use); bad words
    # are matched against the output at every step, so they are bounded like stop strings;
    # choices are compiled into a grammar. (Lists of objects, such as messages and tools, are
    # bounded in the schema itself: protocol.py.)
    max_bad_words: int = 256
    max_bad_word_chars: int = 256
    max_choices: int = 1024
    max_choice_chars: int = 4096
    # Labels: request_id is echoed in the id of every stream chunk (a 1 MB id would be re-sent and
    # re-encoded with each token) and user names a tenant in logs and quotas.
    max_label_chars: int = 256

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompt_chars", "max_stop_strings", "max_stop_chars",
                     "max_bad_words", "max_bad_word_chars", "max_choices", "max_choice_chars",
                     "max_label_chars"):
            v = getattr(self, name)
            if v is None and name == "max_prompt_chars":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")

    def prompt_chars(self, max_model_len: int) -> int:
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return max_model_len * CHARS_PER_TOKEN_BOUND


def check_sizes(body, kind: str, limits: RequestLimits, max_model_len: int) -> None:
    """Stop strings and prompt characters within bounds (ApiError naming the field otherwise)."""
    stop = body.stop
    if isinstance(stop, list):
        if len(stop) > limits.max_stop_strings:
            raise ApiError(400, f"stop holds {len(stop)} strings; at most {limits.max_stop_strings} "
                           "are allowed", "stop")
        for i, s in enumerate(stop):
            if len(s) > limits.max_stop_chars:
                raise ApiError(400, f"stop[{i}] is {len(s)} characters; each stop string may be at "
                               f"most {limits.max_stop_chars}", f"stop.{i}")
    elif isinstance(stop, str) and len(stop) > limits.max_stop_chars:
        raise ApiError(400, f"stop is {len(stop)} characters; a stop string may be at most "
                       f"{limits.max_stop_chars}", "stop")
    cap = limits.prompt_chars(max_model_len)
    if kind == "chat":
        n, param, what = sum(len(m.text()) for m in body.messages), "messages", "message content"
    else:
        prompt = body.prompt
        # A list is all strings or all token ids (pydantic): look at the first item only.
        texts = ([prompt] if isinstance(prompt, str)
                 else prompt if prompt and isinstance(prompt[0], str) else [])
        n, param, what = sum(len(t) for t in texts), "prompt", "prompt text"
    if n > cap:
        how = ("" if limits.max_prompt_chars is not None else
               f" (max_model_len={max_model_len} tokens x {CHARS_PER_TOKEN_BOUND} characters per token)")
        raise ApiError(400, f"{param} holds {n} characters of {what}; this server accepts at most "
                       f"{cap}{how}, checked before tokenizing", param)


def check_lists(body, limits: RequestLimits, vocab_size: int) -> None:
    """Every list and map field of strings or numbers within its bound
    (docs/serving/request-fields.md), a 400 naming the field and the limit otherwise; checked before any of them is tokenized
    or compiled. Lists of objects are bounded by the schema (protocol.py)."""
    so = body.structured_outputs
    bounded = [("allowed_token_ids", body.allowed_token_ids, vocab_size, None),
               ("stop_token_ids", body.stop_token_ids, vocab_size, None),
               ("logit_bias", body.logit_bias, vocab_size, None),
               ("bad_words", body.bad_words, limits.max_bad_words, limits.max_bad_word_chars),
               ("structured_outputs.choice", so.choice if so else None, limits.max_choices,
                limits.max_choice_chars),
               ("guided_choice", getattr(body, "guided_choice", None), limits.max_choices,
                limits.max_choice_chars)]
    for name in ("request_id", "user"):
        value = getattr(body, name)
        if value is not None and len(value) > limits.max_label_chars:
            raise ApiError(400, f"{name} is {len(value)} characters; at most "
                           f"{limits.max_label_chars} are allowed", name)
    for name, value, most, item_chars in bounded:
        if value is None:
            continue
        what = "entries" if isinstance(value, dict) else "items"
        if len(value) > most:
            why = " (the vocabulary size)" if most == vocab_size else ""
            raise ApiError(400, f"{name} holds {len(value)} {what}; at most {most}{why} are allowed",
                           name)
        for i, item in enumerate(value if item_chars else ()):
            if len(item) > item_chars:
                raise ApiError(400, f"{name}[{i}] is {len(item)} characters; each may be at most "
                               f"{item_chars}", f"{name}.{i}")


def check_strings(value, path: str = "", typed: bool = True) -> None:
    """Every string in the validated body (fields, list items, message parts, and the keys and
    values of free-form objects such as a tool's ``parameters`` schema) must be valid Unicode; the
    error names the field by its dotted path, e.g. ``messages.0.content``. ``typed``: pydantic
    checked the value's shape (a list of ints holds nothing else); inside a free-form object
    nothing is known, so every item is looked at."""
    if isinstance(value, str):
        if not value.isascii():  # the common case costs one C scan
            try:
                check_text(path, value)
            except ValueError as e:
                raise ApiError(400, str(e), path) from None
    elif isinstance(value, BaseModel):
        for name, spec in type(value).model_fields.items():
            key = spec.alias or name  # the name the client wrote ("json", not the attribute json_)
            check_strings(getattr(value, name), f"{path}.{key}" if path else key)
    elif isinstance(value, dict):
        if _ascii_keys_and_numbers(value):
            return  # e.g. a whole-vocabulary logit_bias: 49 k keys checked in one C call
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            check_strings(key, where, typed=False)  # a key is a string in JSON
            check_strings(item, where, typed=False)
    elif isinstance(value, (list, tuple)):
        if typed and value and isinstance(value[0], int):
            return  # token ids: pydantic made the whole list ints
        for i, item in enumerate(value):
            check_strings(item, f"{path}.{i}", typed)


def _ascii_keys_and_numbers(d: dict) -> bool:
    keys = list(d)
    return (set(map(type, keys)) <= {str} and "".join(keys).isascii()
            and set(map(type, d.values())) <= {int, float})


class BodyLimitMiddleware:
    """Reads the whole request body (FastAPI would too) but refuses it past ``max_body_bytes``
    with a 413, judged from ``Content-Length`` before reading and from the bytes while reading
    (a chunked body has no length up front). The 413 closes the connection: the unread rest of
    the body would otherwise be parsed as the next request."""

    def __init__(self, app, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"").decode("latin-1")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self._too_large(scope, receive, send, f"is {int(declared)} bytes")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left mid-body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return await self._too_large(scope, receive, send, f"passed {size} bytes while arriving")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            err = ApiError(400, f"the body is not valid UTF-8: byte 0x{body[e.start]:02x} at byte "
                           f"offset {e.start} ({e.reason}); JSON bodies must be UTF-8",
                           f"body.{e.start}")
            return await error_response(err)(scope, receive, send)
        await self.app(scope, _replay(body, receive), send)

    async def _too_large(self, scope, receive, send, what: str) -> None:
        err = ApiError(413, f"the request body {what}; this server accepts at most "
                       f"{self.max_body_bytes} bytes (--max-request-body-bytes)", "body",
                       "body_too_large", {"Connection": "close"})
        await error_response(err)(scope, receive, send)


def _replay(body: bytes, receive):
    """A ``receive`` that hands the app the buffered body once, then the real channel (which
    reports the client's disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay
