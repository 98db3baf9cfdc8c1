"""Llama 3.x JSON calls (vLLM's `llama3_json`): the answer is the calls, `{"name": ..., "parameters": {...}}`,
several separated by `;`, maybe after the `<|python_tag|>` token. An answer that starts otherwise is content."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from tokenmill.tool_parsers.base import Scan, Spell, ToolParser, json_call, json_call_rules

PYTHON_TAG = "<|python_tag|>"
_LEAD = re.compile(r"\s*(?:<\|python_tag\|>\s*)?")
_SEPARATOR = re.compile(r"[\s;]*")


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def scan(self, text: str, final: bool) -> Scan:
        pos = _LEAD.match(text).end()  # type: ignore[union-attr]  # matches any text
        if pos == len(text) or (not final and PYTHON_TAG.startswith(text[pos:].lstrip())):
            return Scan(content=text if final else "")
        if text[pos] != "{":
            return Scan(content=text)
        scan = Scan()
        while True:
            call, obj = json_call(text, pos)
            if call is None:
                open_object = obj.end is None and not obj.broken and not final
                return Scan() if open_object else Scan(content=text)
            scan.calls.append(call)
            if obj.end is None:
                return scan
            following = _SEPARATOR.match(text, obj.end).end()  # type: ignore[union-attr]
            if following < len(text) and text[following] == "{":
                pos = following
                continue
            if final or following < len(text):
                scan.content = text[following:]
            return scan

    def call_grammar(self, tools: Sequence[dict[str, Any]], parallel: bool, spell: Spell) -> str:
        repeat = ' ("; " call)*' if parallel else ""
        return "\n".join([f"start: call{repeat}", *json_call_rules(tools, "parameters")])

    def format_call(self, name: str, arguments: str) -> str:
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": {arguments}}}'
