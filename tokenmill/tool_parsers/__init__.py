"""Tool-call parsers, one module per family's call format (vLLM's `--tool-call-parser` names), over one interface
(base.ToolParser) and one streaming (streaming.ToolCallStreamer)."""

from __future__ import annotations

from tokenmill.tool_parsers.base import Spell, ToolCall, ToolParser, quoted
from tokenmill.tool_parsers.deepseek_v3 import DeepSeekV3Parser
from tokenmill.tool_parsers.hermes import HermesParser
from tokenmill.tool_parsers.llama3_json import Llama3JsonParser
from tokenmill.tool_parsers.mistral import MistralParser
from tokenmill.tool_parsers.pythonic import PythonicParser
from tokenmill.tool_parsers.qwen3_coder import Qwen3CoderParser
from tokenmill.tool_parsers.streaming import ToolCallStreamer

PARSERS: dict[str, type[ToolParser]] = {parser.name: parser for parser in (
    HermesParser, Llama3JsonParser, MistralParser, Qwen3CoderParser, PythonicParser, DeepSeekV3Parser)}

# What a chat template writes when it shows the model its call format, most specific first.
_TEMPLATE_SIGNS: list[tuple[tuple[str, ...], str]] = [
    (("<function=", "<tool_call>"), "qwen3_coder"),
    (("<tool_call>",), "hermes"),
    (("[TOOL_CALLS]",), "mistral"),
    (("tool▁calls▁begin",), "deepseek_v3"),
    (("<|python_start|>",), "pythonic"),
    (("[func_name1(",), "pythonic"),
    (("<|python_tag|>",), "llama3_json"),
    (('"parameters": dictionary of argument name',), "llama3_json"),
]


def detect_parser(chat_template: str | None) -> tuple[str, str]:
    """The parser a chat template asks for, and why; hermes (the format tokenmill itself teaches a template that
    knows no tools) when it shows none."""
    for signs, name in _TEMPLATE_SIGNS:
        if chat_template and all(sign in chat_template for sign in signs):
            return name, "the chat template writes " + " and ".join(repr(s) for s in signs)
    return "hermes", "the chat template shows no call format of its own"


def special_spelling(added_tokens: dict[str, int]) -> Spell:
    """Spell markers for a tokenizer whose added tokens (text -> id) are given: by id where one token is the
    marker (the model emits that token; llguidance matches added tokens only by id), as text otherwise."""
    def spell(marker: str) -> str:
        token = added_tokens.get(marker)
        return f"<[{token}]>" if token is not None else quoted(marker)

    return spell


__all__ = ["PARSERS", "ToolCall", "ToolCallStreamer", "ToolParser", "detect_parser", "special_spelling"]
