"""Tool-call parsers, by vLLM's ``--tool-call-parser`` names, and the tool side of a chat request
(plan.py: tool_choice, the prompt, the forced-call schema, the response's ``tool_calls``)."""

from minserve.server.tool_parsers.base import Extracted, ParsedCall, ToolParser
from minserve.server.tool_parsers.hermes import HermesToolParser
from minserve.server.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,          # <tool_call>{...}</tool_call>: SmolLM2, Qwen, Hermes
    Llama3JsonToolParser.name: Llama3JsonToolParser,  # the output is the JSON call itself
}
# The parser for the default model (SmolLM2-Instruct writes <tool_call> tags).
DEFAULT_TOOL_PARSER = HermesToolParser.name


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"--tool-call-parser must be one of {sorted(TOOL_PARSERS)}, got {name!r}") from None


__all__ = ["DEFAULT_TOOL_PARSER", "Extracted", "ParsedCall", "TOOL_PARSERS", "ToolParser",
           "get_tool_parser"]
