"""The assistant message of a chat choice, whole or streamed: content, ``tool_calls`` and the
finish reason, from the sampled text and the request's ToolPlan (plan.py), plus vLLM's chat
``echo`` (the last message, when it is the assistant's, starts the reply).

Finish reasons follow vLLM: "tool_calls" when an "auto" output held calls, or when a "required"
output ended normally; a named function keeps the engine's reason (OpenAI answers "stop" there).
"""

from __future__ import annotations

from minserve.server.tool_parsers.base import ParsedCall
from minserve.server.tool_parsers.plan import ToolPlan, call_json, calls_of_required, new_call_id


class ChatReply:
    """Builds one chat choice's message; one per request (it holds no per-choice state)."""

    def __init__(self, plan: ToolPlan | None, echo_prefix: str = ""):
        self.plan, self.echo_prefix = plan, echo_prefix

    @property
    def mode(self) -> str:
        return self.plan.mode if self.plan is not None else "none"

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        calls, content = None, text
        if self.mode == "named":
            calls, content = [ParsedCall(self.plan.function, text)], ""
        elif self.mode == "required":
            calls = calls_of_required(text)
            content = "" if calls is not None else text
        elif self.mode == "auto":
            found = self.plan.parser.extract(text)
            calls, content = found.calls or None, found.content if found.calls else text
        message = {"role": "assistant", "content": _join(self.echo_prefix, content)}
        if calls:
            message["tool_calls"] = [call_json(c) for c in self._limit(calls)]
        return message, self._finish(finish_reason, bool(calls))

    def streamer(self) -> "ReplyStream":
        return ReplyStream(self)

    def _limit(self, calls: list[ParsedCall]) -> list[ParsedCall]:
        return calls if self.plan.parallel else calls[:1]

    def _finish(self, finish_reason: str | None, called: bool) -> str | None:
        if finish_reason is None or not called:
            return finish_reason
        if self.mode == "auto" or (self.mode == "required" and finish_reason == "stop"):
            return "tool_calls"
        return finish_reason


def _join(prefix: str, content: str | None) -> str | None:
    if not prefix:
        return content
    return prefix + (content or "")


class ReplyStream:
    """One streamed choice: ``delta(text, finish_reason)`` -> (the chunk's ``delta``, its
    finish reason). Content streams as it comes; "auto" holds back what may be a call until it
    can be parsed, "required" holds everything until the end, "named" streams the arguments."""

    def __init__(self, reply: ChatReply):
        self.reply = reply
        self.prefix = reply.echo_prefix          # sent with the first delta, then cleared
        self.parser = reply.plan.parser.streamer() if reply.mode == "auto" else None
        self.buffer = ""                         # "required": the whole output
        self.calls_sent = 0
        self.named_id: str | None = None

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        mode, content, calls = self.reply.mode, text, []
        if mode == "auto":
            content, calls = self.parser.feed(text)
            if finish_reason is not None:
                tail, more = self.parser.finish()
                content, calls = content + tail, calls + more
        elif mode == "required":
            self.buffer += text
            content = ""
            if finish_reason is not None:
                calls = calls_of_required(self.buffer) or []
                content = "" if calls else self.buffer
        elif mode == "named":
            return self._named(text), finish_reason
        out = {}
        content = self.prefix + content
        self.prefix = ""
        if content:
            out["content"] = content
        entries = self._entries(calls)
        if entries:
            out["tool_calls"] = entries
        return out, self.reply._finish(finish_reason, self.calls_sent > 0)

    def _entries(self, calls: list[ParsedCall]) -> list[dict]:
        entries = []
        for call in calls:
            if not self.reply.plan.parallel and self.calls_sent:
                break
            entries.append(call_json(call, self.calls_sent))
            self.calls_sent += 1
        return entries

    def _named(self, text: str) -> dict:
        out = {"content": self.prefix} if self.prefix else {}
        self.prefix = ""
        if not text:
            return out
        if self.named_id is None:  # the first piece opens the call: id, type, name
            self.named_id = new_call_id()
            entry = {"index": 0, "id": self.named_id, "type": "function",
                     "function": {"name": self.reply.plan.function, "arguments": text}}
        else:
            entry = {"index": 0, "function": {"arguments": text}}
        out["tool_calls"] = [entry]
        return out
