"""The plain-JSON format (vLLM's "llama3_json" parser): the whole output is one or more JSON
objects ``{"name": ..., "arguments"|"parameters": {...}}`` (optionally after Llama 3's
``<|python_tag|>``), separated by ";" or whitespace, or a JSON list of them. An output that does
not start that way, or has anything else in it, is plain content.
"""

from __future__ import annotations

import json

from minserve.server.tool_parsers.base import (Extracted, ToolParser, WholeStreamer,
                                               calls_from_json)

PYTHON_TAG = "<|python_tag|>"


def _looks_like_call(head: str) -> bool:
    return head.startswith(("{", "[", PYTHON_TAG[:len(head)]))


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    instructions = (
        "To call a function, reply with nothing but a JSON object holding its name and its "
        'arguments: {"name": "<function name>", "arguments": {<arguments as JSON>}}; for several '
        "calls, separate the objects with \";\".")

    def extract(self, text: str) -> Extracted:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        if not body.startswith(("{", "[")):
            return Extracted(text, [])
        decoder, calls, at = json.JSONDecoder(), [], 0
        try:
            while at < len(body):
                value, at = decoder.raw_decode(body, at)
                found = calls_from_json(value)
                if found is None:
                    return Extracted(text, [])
                calls += found
                while at < len(body) and body[at] in "; \t\r\n":
                    at += 1
        except ValueError:
            return Extracted(text, [])
        return Extracted(None, calls)

    def streamer(self) -> WholeStreamer:
        return WholeStreamer(self, _looks_like_call)
