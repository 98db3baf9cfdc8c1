"""Qwen3-Coder's XML calls (vLLM's `qwen3_coder`):

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

A value is text; it becomes JSON by its parameter's type in the tool's schema (a string stays a string; numbers,
booleans, objects and lists are read as JSON, or as Python literals). The arguments object grows a parameter at a
time as each one closes."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from typing import Any

from tokenmill.tool_parsers.base import (
    PartialCall,
    Scan,
    Spell,
    ToolParser,
    alternatives,
    json_grammar,
    quoted,
    scan_blocks,
    schema_parameters,
)

START, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")
PARAMETER_END, FUNCTION_END = "</parameter>", "</function>"


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"
    markers = (START, END)

    def scan(self, text: str, final: bool) -> Scan:
        return scan_blocks(text, final, START, END, self._block)

    def _block(self, text: str, body: int, final: bool) -> tuple[PartialCall | None, int]:
        function_end = text.find(FUNCTION_END, body)  # a value may hold the end tag's text
        if function_end >= 0:
            end = text.find(END, function_end)
        else:  # an open function goes on; a block that never starts one ends at the tag
            end = text.find(END, body) if final or _FUNCTION.match(text, body) is None else -1
        return self._call(text[body:end if end >= 0 else len(text)]), end

    def _call(self, body: str) -> PartialCall | None:
        function = _FUNCTION.match(body)
        if function is None:
            return None
        name = function.group(1).strip()
        properties = (self.tools.get(name, {}).get("parameters") or {}).get("properties") or {}
        arguments = []
        pos = function.end()
        while (parameter := _PARAMETER.match(body, pos)) is not None:
            end = body.find(PARAMETER_END, parameter.end())
            if end < 0:
                break
            key = parameter.group(1).strip()
            value = body[parameter.end():end].removeprefix("\n").removesuffix("\n")
            arguments.append(f"{json.dumps(key, ensure_ascii=False)}: {_json_value(value, properties.get(key))}")
            pos = end + len(PARAMETER_END)
        done = body[pos:].lstrip().startswith(FUNCTION_END)
        return PartialCall(name, "{" + ", ".join(arguments) + ("}" if done else ""), done=done)

    def call_grammar(self, tools: Sequence[dict[str, Any]], parallel: bool, spell: Spell) -> str:
        rules = []
        for i, tool in enumerate(tools):
            parts = []
            for j, (key, prop, required) in enumerate(schema_parameters(tool)):
                rule = f"param_{i}_{j}"
                rules.append(f"{rule}: {quoted(f'<parameter={key}>' + chr(10))} value_{i}_{j} "
                             f"{quoted(chr(10) + PARAMETER_END + chr(10))}")
                rules.append(f"value_{i}_{j}: {_value_grammar(prop)}")
                parts.append(rule if required else f"{rule}?")
            head = quoted(f"\n<function={tool['name']}>\n")
            rules.append(f"call_{i}: {spell(START)} {head} {' '.join(parts)} "
                         f"{quoted(FUNCTION_END + chr(10))} {spell(END)}")
        repeat = ' ("\\n" call)*' if parallel else ""
        return "\n".join([f"start: call{repeat}", "call: " + alternatives([f"call_{i}" for i in range(len(tools))]),
                          *rules])

    def format_call(self, name: str, arguments: str) -> str:
        try:
            values = json.loads(arguments)
        except ValueError:
            values = {}
        params = "".join(f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value)}\n"
                         f"{PARAMETER_END}\n" for key, value in (values.items() if isinstance(values, dict) else ()))
        return f"{START}\n<function={name}>\n{params}{FUNCTION_END}\n{END}"


def _json_value(value: str, schema: dict[str, Any] | None) -> str:
    """A parameter's text as JSON, by its schema's type."""
    kind = (schema or {}).get("type")
    if kind == "string" or (kind is None and schema and all(isinstance(v, str) for v in schema.get("enum", [1]))):
        return json.dumps(value, ensure_ascii=False)
    try:
        return json.dumps(json.loads(value), ensure_ascii=False)
    except ValueError:
        pass
    try:
        return json.dumps(ast.literal_eval(value), ensure_ascii=False)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return json.dumps(value, ensure_ascii=False)


def _value_grammar(schema: dict[str, Any]) -> str:
    """A parameter's value in a forced call: one line of text for a string, the choices of an enum, else JSON."""
    if "enum" in schema:
        return alternatives([quoted(v if isinstance(v, str) else json.dumps(v)) for v in schema["enum"]])
    if schema.get("type") == "string":
        limit = schema.get("maxLength")
        return f"/[^<\\n]{{1,{int(limit)}}}/" if limit else "/[^<\\n]+/"
    return json_grammar(schema)
