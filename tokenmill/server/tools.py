"""Tool calling (OpenAI's `tools` / `tool_choice`) around a family's parser (tokenmill/tool_parsers): the tools in
the prompt, and the grammar that makes a forced call parse and match its function's schema, written in the
family's own call format."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Sequence
from typing import Any

from tokenmill.model.tokenizer import Tokenizer
from tokenmill.structured_output.params import StructuredOutputsParams
from tokenmill.tool_parsers import PARSERS, Spell, ToolParser, detect_parser, special_spelling

logger = logging.getLogger(__name__)


def prepare_conversation(messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, template: str,
                         parser: ToolParser) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Messages and extra template variables. A template that knows tools (it reads `tools`, as Hugging Face's
    tool-use templates do) gets them as it expects; for one that does not, the tool list joins the system message
    and earlier calls become the parser's call text in the assistant's content, so the model sees both."""
    if "tools" in template:
        return ([_arguments_as_objects(m) for m in messages],
                {"tools": [{"type": "function", "function": t} for t in tools]} if tools else {})
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls and "tool_calls" not in template:
            blocks = [parser.format_call(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            message = {**message, "content": "\n".join(filter(None, [message.get("content") or "", *blocks]))}
            message.pop("tool_calls")
        out.append(message)
    if tools:
        instructions = parser.instructions(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + instructions}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out, {}


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant's earlier calls with their arguments as objects, not JSON text: tool-use templates write
    them with `tojson` or walk their items (vLLM hands them over the same way)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = []
    for call in calls:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            with contextlib.suppress(ValueError):
                function = {**function, "arguments": json.loads(arguments)}
        parsed.append({**call, "function": function})
    return {**message, "tool_calls": parsed}


def forced_call_constraint(parser: ToolParser, tools: Sequence[dict[str, Any]], name: str | None, parallel: bool,
                           spell: Spell) -> StructuredOutputsParams:
    """A grammar admitting exactly one call of function `name`, or (tool_choice "required": name None) one or more
    calls of any of the tools (one when `parallel` is false), in the parser's format; arguments follow each
    function's JSON schema."""
    chosen = [tool for tool in tools if name is None or tool["name"] == name]
    if not chosen:
        raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")
    return StructuredOutputsParams(grammar=parser.call_grammar(chosen, parallel and name is None, spell))


def resolve_parser(name: str | None, chat_template: str | None) -> type[ToolParser]:
    """--tool-call-parser's parser; `auto` (and no flag: forced calls still need a format) reads the chat
    template."""
    if name in (None, "auto"):
        name, why = detect_parser(chat_template)
        logger.info("tool calls: parser %s (%s)", name, why)
    return PARSERS[name]


def marker_tokens(tokenizer: Tokenizer, parser: type[ToolParser]) -> tuple[Spell, bool]:
    """How grammars spell the parser's markers for this tokenizer, and whether any of them is a special token
    (one that decoding skips by default, so outputs that may hold calls must keep special tokens)."""
    added = tokenizer.backend.get_added_tokens_decoder()
    special = {token.content for token in added.values() if token.special}
    return (special_spelling({token.content: token_id for token_id, token in added.items()}),
            any(marker in special for marker in parser.markers))
