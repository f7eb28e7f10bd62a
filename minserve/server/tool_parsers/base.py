"""What every tool-call parser shares: the parsed call, the split of an output into content and
calls, and the two ways of streaming (calls delimited by tags, or a whole-output JSON form).

A parser sees only the model's text. It never fails a request: text it cannot read as tool calls
is returned as plain content (as vLLM's parsers do), so a model that answers in prose still gets
its answer through.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class ParsedCall:
    name: str
    arguments: str      # a JSON object as text, OpenAI's convention


@dataclass
class Extracted:
    content: str | None           # text outside the calls (None when there is none)
    calls: list[ParsedCall]


def calls_from_json(value) -> list[ParsedCall] | None:
    """``{"name": ..., "arguments": {...}}`` or a list of them -> calls; None if the value is not
    of that shape. vLLM's JSON parsers also accept "parameters" for "arguments"."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):  # some models send the arguments already as JSON text
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append(ParsedCall(item["name"], json.dumps(args, ensure_ascii=False)))
    return calls


class ToolParser:
    """Splits a finished output into content and tool calls (``extract``) and, for streams,
    makes a per-choice ``Streamer``. Subclasses set ``name`` and ``instructions`` (how the model
    is told to call tools when its chat template has no tools section)."""

    name = ""
    instructions = ""

    def extract(self, text: str) -> Extracted:
        raise NotImplementedError

    def streamer(self) -> "Streamer":
        raise NotImplementedError


class Streamer:
    """Incremental parsing of one streamed output: ``feed`` each new piece of text and get back
    (content to send now, calls completed now); ``finish`` flushes what was held back."""

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ParsedCall]]:
        raise NotImplementedError


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker`` (they must
    wait for the next piece before they can be sent as content)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class TaggedStreamer(Streamer):
    """Calls between ``start`` and ``end`` tags, content around them: content streams as it comes
    (less a possible half tag), each call goes out once its end tag arrives."""

    def __init__(self, parser: ToolParser, start: str, end: str):
        self.parser, self.start, self.end = parser, start, end
        self.pending = ""      # text not yet sent or parsed
        self.in_call = False

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self.pending += text
        content, calls = "", []
        while True:
            if not self.in_call:
                at = self.pending.find(self.start)
                if at < 0:
                    keep = held_back(self.pending, self.start)
                    content += self.pending[:len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep:]
                    return content, calls
                content += self.pending[:at]
                self.pending, self.in_call = self.pending[at:], True
            at = self.pending.find(self.end)
            if at < 0:
                return content, calls
            segment = self.pending[:at + len(self.end)]
            self.pending, self.in_call = self.pending[at + len(self.end):], False
            found = self.parser.extract(segment)
            calls += found.calls
            if not found.calls:  # not a readable call: the client gets the text as it was
                content += found.content or ""

    def finish(self) -> tuple[str, list[ParsedCall]]:
        rest, self.pending = self.pending, ""
        if not rest:
            return "", []
        found = self.parser.extract(rest)  # an unclosed last call, or a held-back half tag
        return (found.content or "") if not found.calls else "", found.calls


class WholeStreamer(Streamer):
    """For formats where the whole output is the call(s): once the output starts like a call,
    everything is held until the end and parsed then; otherwise it streams as content."""

    def __init__(self, parser: ToolParser, looks_like_call):
        self.parser, self.looks_like_call = parser, looks_like_call
        self.buffer = ""
        self.mode = None       # None: undecided (only whitespace so far), "call" or "content"

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        if self.mode == "content":
            return text, []
        self.buffer += text
        head = self.buffer.lstrip()
        if self.mode is None and head:
            self.mode = "call" if self.looks_like_call(head) else "content"
            if self.mode == "content":
                out, self.buffer = self.buffer, ""
                return out, []
        return "", []

    def finish(self) -> tuple[str, list[ParsedCall]]:
        rest, self.buffer = self.buffer, ""
        if not rest:
            return "", []
        found = self.parser.extract(rest)
        return (found.content or "") if not found.calls else "", found.calls
