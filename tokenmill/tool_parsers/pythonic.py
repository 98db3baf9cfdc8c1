"""Pythonic calls (vLLM's `pythonic`: Llama 3.2 / 4 and some small models): the answer is a Python list of
calls, `[get_weather(city="Paris"), get_time(timezone="Asia/Tokyo")]`, maybe between `<|python_start|>` and
`<|python_end|>`. Keyword values are Python literals (JSON's true / false / null are read too); a call's
arguments arrive whole when its parenthesis closes."""

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
    schema_parameters,
)

START, END = "<|python_start|>", "<|python_end|>"
_LEAD = re.compile(r"\s*(?:<\|python_start\|>\s*)?")
_SEPARATOR = re.compile(r"\s*,?")
_CALL = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")
_LIST_END = re.compile(r"\s*\](?:\s*<\|python_end\|>)?")
_JSON_LITERALS = {"true": True, "false": False, "null": None}


class PythonicParser(ToolParser):
    name = "pythonic"
    markers = (START, END)

    def scan(self, text: str, final: bool) -> Scan:
        pos = _LEAD.match(text).end()  # type: ignore[union-attr]  # matches any text
        rest = text[pos:]
        if not rest or (not final and (START.startswith(rest.lstrip()) or _could_start_call(rest))):
            return Scan(content=text if final else "")
        if not rest.startswith("[") or _CALL.match(text, pos + 1) is None:
            return Scan(content=text)
        scan = Scan()
        pos += 1
        while (call := _CALL.match(text, pos)) is not None:
            parenthesis = _closing_parenthesis(text, call.end())
            partial = PartialCall(call.group(1))
            scan.calls.append(partial)
            if parenthesis is None:
                return scan
            arguments = _arguments(text[call.end():parenthesis])
            if arguments is None:  # not Python keyword arguments: the whole answer is content
                return Scan(content=text)
            partial.arguments, partial.done = arguments, True
            pos = _SEPARATOR.match(text, parenthesis + 1).end()  # type: ignore[union-attr]  # matches any text
        close = _LIST_END.match(text, pos)
        if close is None:  # the list goes on (or stops here at the end: the rest is content)
            scan.content = text[pos:] if final else ""
            return scan
        after = text[close.end():]
        if final or not END.startswith(after.lstrip()):
            scan.content = after
        return scan

    def call_grammar(self, tools: Sequence[dict[str, Any]], parallel: bool, spell: Spell) -> str:
        rules = []
        for i, tool in enumerate(tools):
            parts = []
            for j, (key, prop, required) in enumerate(schema_parameters(tool)):
                rules.append(f"kwarg_{i}_{j}: {quoted(key + '=')} value_{i}_{j}")
                rules.append(f"value_{i}_{j}: {_value_grammar(prop)}")
                parts.append((f"kwarg_{i}_{j}", required))
            # keyword arguments in schema order, separated by ", ", the optional ones optional
            body = _keywords(parts)
            rules.append(f"call_{i}: {quoted(tool['name'] + '(')} {body} \")\"")
        repeat = ' (", " call)*' if parallel else ""
        return "\n".join([f'start: "[" call{repeat} "]"', "call: " + alternatives(
            [f"call_{i}" for i in range(len(tools))]), *rules])

    def format_call(self, name: str, arguments: str) -> str:
        try:
            values = json.loads(arguments)
        except ValueError:
            values = {}
        pairs = ", ".join(f"{key}={value!r}" for key, value in (values.items() if isinstance(values, dict) else ()))
        return f"[{name}({pairs})]"


def _could_start_call(rest: str) -> bool:
    """`rest` is too short to tell whether a call list starts: `[`, `[get_wea`..."""
    stripped = rest.lstrip()
    return stripped == "[" or re.fullmatch(r"\[\s*[A-Za-z_][\w.]*\s*", stripped) is not None


def _closing_parenthesis(text: str, pos: int) -> int | None:
    """Where the parenthesis open before text[pos] closes (strings and brackets skipped), None if it does not."""
    depth, quote, escaped = 0, "", False
    for i in range(pos, len(text)):
        c = text[i]
        if quote:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                return i if c == ")" else None
            depth -= 1
    return None


def _arguments(source: str) -> str | None:
    """Keyword arguments' source -> their JSON object, None if they are not keyword arguments of literals."""
    try:
        call = ast.parse(f"f({source})", mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(call, ast.Call) or call.args:
        return None
    values: dict[str, Any] = {}
    for keyword in call.keywords:
        if keyword.arg is None:
            return None
        try:
            values[keyword.arg] = ast.literal_eval(_python_literals(keyword.value))
        except ValueError:
            return None
    return json.dumps(values, ensure_ascii=False)


def _python_literals(node: ast.expr) -> ast.expr:
    """JSON's true / false / null, written by models inside Python calls, as the constants they mean."""
    class Literals(ast.NodeTransformer):
        def visit_Name(self, name: ast.Name) -> ast.AST:  # noqa: N802 - ast's visitor naming
            if name.id in _JSON_LITERALS:
                return ast.copy_location(ast.Constant(_JSON_LITERALS[name.id]), name)
            return name

    return Literals().visit(node)  # type: ignore[no-any-return]


def _value_grammar(schema: dict[str, Any]) -> str:
    """A keyword value in a forced call: Python's booleans and None, else JSON (whose strings, numbers, lists and
    objects Python reads alike)."""
    kind = schema.get("type")
    if kind == "boolean":
        return '"True" | "False"'
    if kind == "null":
        return '"None"'
    return json_grammar(schema)


def _keywords(parts: list[tuple[str, bool]]) -> str:
    """Lark for keyword arguments in order, separated by ", ": the required ones always, the others optional."""
    def after_first(i: int) -> str:  # items from i on, each after ", "
        return " ".join(f'(", " {rule})' + ("" if required else "?") for rule, required in parts[i:])

    def first_on(i: int) -> str:  # items from i on, the first written without ", "
        if i == len(parts):
            return ""
        rule, required = parts[i]
        with_it = f"{rule} {after_first(i + 1)}".strip()
        if required:
            return with_it
        without = first_on(i + 1)
        return f"({with_it} | {without})" if without else f"({with_it})?"

    return first_on(0)
