"""What every tool-call parser provides, and the pieces the formats share.

A parser reads a model's output in its family's call format. Its one hard job is `scan`: the output so far, maybe
cut anywhere, split into the content that can no longer become part of a call and the calls begun so far (a call
appears once its name is complete; its arguments grow by appending). Whole-output parsing and streaming are both
built on it (tool_parsers/streaming.py), so that the deltas of any chunking add up to the whole parse.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tokenmill.structured_output.backend import JSON_OPTIONS, closed_objects

# A marker's spelling in a Lark grammar: `<[id]>` where the tokenizer holds it as one added token (the model emits
# that token, and llguidance only matches added tokens named by id), else the quoted text.
Spell = Callable[[str], str]


def quoted(text: str) -> str:
    return json.dumps(text)


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


@dataclass
class PartialCall:
    name: str
    arguments: str = ""  # the arguments' JSON text generated so far
    done: bool = False  # the call's end was seen


@dataclass
class Scan:
    content: str = ""  # text that is not, and can no longer become, part of a call
    calls: list[PartialCall] = field(default_factory=list)


class ToolParser:
    """One family's call format. `tools` are the request's function definitions (OpenAI's `function` objects):
    lenient parsing accepts a loose call only when it names one of them; some formats read their parameter types."""

    name: ClassVar[str]
    # texts that tokenizers of this family hold as single tokens (forced-call grammars name them by id; the output
    # keeps them when they are special tokens)
    markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: Sequence[dict[str, Any]] = (), lenient: bool = True) -> None:
        self.tools = {tool["name"]: tool for tool in tools}
        self.lenient = lenient

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output. A call that is not valid (arguments that are not a JSON object)
        leaves the whole text as content, as vLLM's parsers do; a last call cut short (max_tokens) after complete
        ones is dropped, the complete ones kept; one cut short alone leaves the text as content."""
        scan = self.scan(text, final=True)
        done = [call for call in scan.calls if call.done]
        if not done or any(not _is_object(call.arguments) for call in done):
            return text.strip() or None, []
        return scan.content.strip() or None, [ToolCall(call.name, call.arguments) for call in done]

    def call_grammar(self, tools: Sequence[dict[str, Any]], parallel: bool, spell: Spell) -> str:
        """A Lark grammar admitting one call of any of `tools` (one or more when `parallel`), in this format."""
        raise NotImplementedError

    def format_call(self, name: str, arguments: str) -> str:
        """An earlier call, as the model writes it (for chat templates that know no tools)."""
        raise NotImplementedError

    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        """The system-prompt text that lists the tools and shows this format (templates that know no tools)."""
        listing = "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools)
        example = self.format_call("<function name>", "<the arguments as a JSON object>")
        return ("You can call functions to answer the user. Their signatures, as JSON schemas, are listed inside "
                f"<tools></tools>:\n<tools>\n{listing}\n</tools>\n\nTo call a function, reply with:\n{example}")


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def json_grammar(schema: dict[str, Any]) -> str:
    """A Lark item for a JSON value of the schema, in the engine's fixed JSON spacing."""
    return f"%json {json.dumps({**closed_objects(schema), 'x-guidance': JSON_OPTIONS})}"


def arguments_rule(rule: str, tool: dict[str, Any]) -> str:
    """`rule: %json SCHEMA`: the tool's parameters as one JSON object."""
    return f"{rule}: {json_grammar(tool.get('parameters') or {'type': 'object'})}"


def alternatives(rules: Sequence[str]) -> str:
    return " | ".join(rules)


def schema_parameters(tool: dict[str, Any]) -> list[tuple[str, dict[str, Any], bool]]:
    """A function's parameters in schema order: (name, schema, required)."""
    schema = tool.get("parameters") or {}
    required = set(schema.get("required") or ())
    return [(key, prop, key in required) for key, prop in (schema.get("properties") or {}).items()]


def json_call_rules(tools: Sequence[dict[str, Any]], arguments_key: str, before: str = "",
                    after: str = "") -> list[str]:
    """Lark rules `call` (any of the tools) for calls written as one JSON object, {"name": ..., KEY: {...}},
    between the `before` and `after` items."""
    rules = ["call: " + alternatives([f"call_{i}" for i in range(len(tools))])]
    for i, tool in enumerate(tools):
        head = quoted('{"name": ' + json.dumps(tool["name"], ensure_ascii=False) + f', "{arguments_key}": ')
        rules.append(" ".join(filter(None, [f"call_{i}:", before, head, f"args_{i}", '"}"', after])))
        rules.append(arguments_rule(f"args_{i}", tool))
    return rules


def held_back(text: str, pos: int, markers: Sequence[str]) -> int:
    """How many characters at the end of text[pos:] could be the start of one of the markers (kept back until
    the next characters say)."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text) - pos), longest, -1):
            if marker.startswith(text[len(text) - n:]):
                longest = n
                break
    return longest


# (the text, where a block's body starts, final) -> (its call or None, where its end tag starts: -1 while open)
BlockReader = Callable[[str, int, bool], tuple["PartialCall | None", int]]


def scan_blocks(text: str, final: bool, start_tag: str, end_tag: str, read: BlockReader,
                dropped: Sequence[str] = ()) -> Scan:
    """Calls in tagged blocks between content (hermes, qwen3_coder, deepseek_v3). A complete block that holds no
    whole call is content; one cut short before its name is content only if no call came before it. `dropped`
    markers (those around a group of blocks) are taken out of the content."""
    scan = Scan()

    def content(piece: str) -> str:
        for marker in dropped:
            piece = piece.replace(marker, "")
        return piece

    pos = 0
    while True:
        start = text.find(start_tag, pos)
        if start < 0:
            keep = 0 if final else held_back(text, pos, (start_tag, *dropped))
            scan.content += content(text[pos:len(text) - keep])
            return scan
        scan.content += content(text[pos:start])
        call, end = read(text, start + len(start_tag), final)
        if end < 0:
            if call is not None:
                scan.calls.append(call)
            elif final and not scan.calls:
                scan.content += text[start:]
            return scan
        if call is None or not call.done:
            scan.content += text[start:end + len(end_tag)]
        else:
            scan.calls.append(call)
        pos = end + len(end_tag)


# ------------------------------------------------------------------ JSON text, possibly cut short


def json_value_end(text: str, start: int) -> int | None:
    """Where the JSON value starting at text[start] ends (exclusive), or None if the text stops inside it. Only
    nesting and strings are tracked: validity is json.loads' job."""
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
            if depth == 0:
                return i  # the end of a number or literal inside an object or list
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and c in ",; \t\r\n" and i > start:
            return i
    return None


def skip_whitespace(text: str, pos: int) -> int:
    """Where the text after `pos` stops being whitespace (between a format's markers and its calls)."""
    return len(text) - len(text[pos:].lstrip()) if pos < len(text) else pos


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


@dataclass
class JsonObject:
    """The top-level fields of a JSON object read so far: key -> (value start, value end or None)."""

    fields: dict[str, tuple[int, int | None]]
    end: int | None  # after the closing brace; None while open
    broken: bool = False  # not an object's text (a call cannot be read from it)


def json_object(text: str, start: int) -> JsonObject:
    """Read the object whose `{` is text[start] as far as the text goes."""
    fields: dict[str, tuple[int, int | None]] = {}
    pos = _skip_space(text, start + 1)
    while pos < len(text):
        if text[pos] == "}":
            return JsonObject(fields, pos + 1)
        if text[pos] != '"':
            return JsonObject(fields, None, broken=True)
        key_end = json_value_end(text, pos)
        if key_end is None:
            break
        try:
            key = json.loads(text[pos:key_end])
        except ValueError:
            return JsonObject(fields, None, broken=True)
        pos = _skip_space(text, key_end)
        if pos >= len(text):
            break
        if text[pos] != ":":
            return JsonObject(fields, None, broken=True)
        value = _skip_space(text, pos + 1)
        if value >= len(text):
            break
        value_end = json_value_end(text, value)
        fields[key] = (value, value_end)
        if value_end is None:
            break
        pos = _skip_space(text, value_end)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_space(text, pos + 1)
    return JsonObject(fields, None)


def string_field(text: str, obj: JsonObject, key: str) -> str | None:
    """A complete string value of the object, else None."""
    span = obj.fields.get(key)
    if span is None or span[1] is None:
        return None
    try:
        value = json.loads(text[span[0]:span[1]])
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def json_call(text: str, start: int, name_key: str = "name",
              argument_keys: Sequence[str] = ("arguments", "parameters")) -> tuple[PartialCall | None, JsonObject]:
    """A call written as one JSON object ({"name": ..., "arguments": {...}}) starting at text[start]: the call once
    its name is complete (arguments so far; done with the object), and the object as read."""
    obj = json_object(text, start)
    name = string_field(text, obj, name_key)
    if name is None or obj.broken:
        return None, obj
    call = PartialCall(name, done=obj.end is not None)
    for key in argument_keys:
        if key in obj.fields:
            value_start, value_end = obj.fields[key]
            call.arguments = text[value_start:value_end if value_end is not None else len(text)]
            break
    else:
        if call.done:
            call.arguments = "{}"  # a call without arguments
    return call, obj
