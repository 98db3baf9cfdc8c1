"""Tool calling (OpenAI's `tools` / `tool_choice`): the tools in the prompt, a grammar that makes a forced call
parse and match its function's schema, and the parser that turns output text into `tool_calls`, whole or
streamed in pieces.

Calls are written in the Hermes format (vLLM's `--tool-call-parser hermes`, used by Qwen, Hermes and SmolLM-style
templates): one `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` block per call.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.structured_output.backend import JSON_OPTIONS, closed_objects
from tokenmill.structured_output.params import StructuredOutputsParams

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_CALL_PARSERS = ("hermes",)
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def call_prefix(name: str) -> str:
    return f'{TOOL_CALL_START}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


CALL_SUFFIX = "}\n" + TOOL_CALL_END


def format_call(name: str, arguments: str) -> str:
    return call_prefix(name) + arguments + CALL_SUFFIX


# ------------------------------------------------------------------ the prompt


def tools_instructions(tools: Sequence[dict[str, Any]]) -> str:
    listing = "\n".join(json.dumps({"type": "function", "function": tool}, ensure_ascii=False) for tool in tools)
    return ("You can call functions to answer the user. Their signatures, as JSON schemas, are listed inside "
            f"<tools></tools>:\n<tools>\n{listing}\n</tools>\n\nTo call a function, reply with one block per call:\n"
            f'{TOOL_CALL_START}\n{{"name": <function name>, "arguments": <the arguments as a JSON object>}}\n'
            f"{TOOL_CALL_END}")


def prepare_conversation(messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
                         template: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Messages and extra template variables. A template that knows tools (it reads `tools`, as Hugging Face's
    tool-use templates do) gets them as it expects; for one that does not, the tool list joins the system message
    and earlier calls become Hermes blocks in the assistant's content, so the model sees both."""
    if "tools" in template:
        return messages, ({"tools": [{"type": "function", "function": t} for t in tools]} if tools else {})
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls and "tool_calls" not in template:
            blocks = [format_call(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            message = {**message, "content": "\n".join(filter(None, [message.get("content") or "", *blocks]))}
            message.pop("tool_calls")
        out.append(message)
    if tools:
        instructions = tools_instructions(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + instructions}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out, {}


# ------------------------------------------------------------------ the grammar for forced calls


def forced_call_constraint(tools: Sequence[dict[str, Any]], name: str | None,
                           parallel: bool = True) -> StructuredOutputsParams:
    """A grammar admitting exactly one call of function `name`, or (tool_choice "required": name None) one or more
    calls of any of the tools (one when `parallel` is false); arguments follow each function's JSON schema."""
    chosen = [tool for tool in tools if name is None or tool["name"] == name]
    if not chosen:
        raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")
    rules = []
    for i, tool in enumerate(chosen):
        schema = closed_objects(tool.get("parameters") or {"type": "object"})
        schema = {**schema, "x-guidance": JSON_OPTIONS}
        rules.append(f"call_{i}: {json.dumps(call_prefix(tool['name']))} args_{i} {json.dumps(CALL_SUFFIX)}")
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    repeat = ' ("\\n" call)*' if parallel and name is None else ""
    start = [f"start: call{repeat}", "call: " + " | ".join(f"call_{i}" for i in range(len(chosen)))]
    return StructuredOutputsParams(grammar="\n".join(start + rules))


# ------------------------------------------------------------------ output -> tool_calls


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI's API carries it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or new_call_id()

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def json_value_end(text: str, start: int) -> int | None:
    """Where the JSON value starting at text[start] ends (exclusive), or None if the text stops inside it. Only
    nesting and strings are tracked: the value itself was produced under a grammar or is checked by json.loads."""
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth <= 0:
                return i + 1
        elif depth == 0 and c in ", \t\r\n" and i > start:
            return i
    return None


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output. Any block that is not a valid call leaves the whole text as content;
    a last block cut short (max_tokens) after complete calls is dropped, the complete calls kept."""
    calls: list[ToolCall] = []
    content: list[str] = []
    pos = 0
    while (start := text.find(TOOL_CALL_START, pos)) >= 0:
        content.append(text[pos:start])
        end = text.find(TOOL_CALL_END, start)
        if end < 0:
            if not calls:
                return text, []
            pos = len(text)
            break
        try:
            call = json.loads(text[start + len(TOOL_CALL_START):end])
            arguments = call.get("arguments", call.get("parameters", {}))
            calls.append(ToolCall(str(call["name"]), json.dumps(arguments, ensure_ascii=False)))
        except (ValueError, KeyError, TypeError, AttributeError):
            return text, []
        pos = end + len(TOOL_CALL_END)
    content.append(text[pos:])
    return "".join(content).strip() or None, calls


class ToolCallStreamer:
    """Turns output text, delta by delta, into content deltas and OpenAI tool-call deltas: a call's id, type and
    name once its name is complete, then its arguments in pieces as they are generated."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # text before this is sent (as content) or belongs to finished calls
        self.call_start: int | None = None  # where the open call's body starts
        self.num_calls = 0
        self.header_sent = False
        self.args_sent = 0  # characters of the open call's arguments sent

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        while True:
            if self.call_start is None:
                start = self.text.find(TOOL_CALL_START, self.pos)
                if start < 0:
                    keep = 0 if final else _partial_tag_length(self.text, self.pos)
                    content.append(self.text[self.pos:len(self.text) - keep])
                    self.pos = len(self.text) - keep
                    break
                content.append(self.text[self.pos:start])
                self.call_start = self.pos = start + len(TOOL_CALL_START)
                self.header_sent, self.args_sent = False, 0
            end = self.text.find(TOOL_CALL_END, self.call_start)
            deltas += self._call_deltas(self.text[self.call_start:end if end >= 0 else len(self.text)])
            if end < 0:
                break
            self.num_calls += self.header_sent
            self.call_start = None
            self.pos = end + len(TOOL_CALL_END)
        return "".join(content), deltas

    def _call_deltas(self, body: str) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        if not self.header_sent:
            name = _NAME.search(body)
            if name is None:
                return deltas
            self.header_sent = True
            deltas.append({"index": self.num_calls, "id": new_call_id(), "type": "function",
                           "function": {"name": json.loads(f'"{name.group(1)}"'), "arguments": ""}})
        arguments = _ARGUMENTS.search(body)
        if arguments is not None:
            end = json_value_end(body, arguments.end())
            text = body[arguments.end():end if end is not None else len(body)]
            if len(text) > self.args_sent:
                deltas.append({"index": self.num_calls, "function": {"arguments": text[self.args_sent:]}})
                self.args_sent = len(text)
        return deltas

    @property
    def called(self) -> bool:
        return self.num_calls > 0 or self.header_sent


def _partial_tag_length(text: str, pos: int) -> int:
    """Length of the longest end of text[pos:] that could be the start of a tool-call tag (held back)."""
    for n in range(min(len(TOOL_CALL_START) - 1, len(text) - pos), 0, -1):
        if TOOL_CALL_START.startswith(text[len(text) - n:]):
            return n
    return 0
