"""The "hermes" format (vLLM's parser name): each call is a JSON object between ``<tool_call>``
and ``</tool_call>`` tags, with text before the first call as content.

This is the format SmolLM2's instruct models were tuned on, except that SmolLM2 writes a JSON
*list* of calls between one pair of tags; both are read here. A last call whose end tag never came
(the output hit max_tokens or a stop string) is still read if its JSON is complete, as vLLM does.
"""

from __future__ import annotations

import json
import re

from minserve.server.tool_parsers.base import (Extracted, TaggedStreamer, ToolParser,
                                               calls_from_json)

START, END = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"
    instructions = (
        "To call a function, reply with a JSON object holding its name and its arguments between "
        f"{START} and {END} tags, one pair of tags per call:\n"
        f'{START}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n{END}')

    def extract(self, text: str) -> Extracted:
        if START not in text:
            return Extracted(text, [])
        calls = []
        for body in CALL.findall(text):
            try:
                found = calls_from_json(json.loads(body))
            except ValueError:
                found = None
            if found is None:  # one unreadable call: give the whole text back as content
                return Extracted(text, [])
            calls += found
        content = text[:text.index(START)]
        return Extracted(content if content.strip() else None, calls)

    def streamer(self) -> TaggedStreamer:
        return TaggedStreamer(self, START, END)
