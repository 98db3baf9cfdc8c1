"""Mistral calls (vLLM's `mistral`): content, then the `[TOOL_CALLS]` token and the calls, either as one JSON list
`[{"name": ..., "arguments": {...}}, ...]` (tokenizer v3, Mistral-7B-Instruct-v0.3, Mistral Nemo) or as
`NAME[ARGS]{...}` per call, each after its own `[TOOL_CALLS]` (tokenizer v11 and later)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from tokenmill.tool_parsers.base import (
    PartialCall,
    Scan,
    Spell,
    ToolParser,
    held_back,
    json_call,
    json_call_rules,
    json_value_end,
    skip_whitespace,
)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAMED = re.compile(r"([A-Za-z0-9_.\-]+)\s*(?:\[ARGS\])?\s*")


class MistralParser(ToolParser):
    name = "mistral"
    markers = (TOOL_CALLS, ARGS)

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find(TOOL_CALLS)
        if start < 0:
            return Scan(content=text[:len(text) - (0 if final else held_back(text, 0, (TOOL_CALLS,)))])
        scan = Scan(content=text[:start])
        pos = start + len(TOOL_CALLS)
        while True:
            pos = skip_whitespace(text, pos)
            if pos >= len(text):
                return scan
            end = self._list(text, pos, scan) if text[pos] == "[" else self._named(text, pos, scan, final)
            if end is None:  # open (or broken: then the rest is content)
                return scan
            pos = skip_whitespace(text, end)
            if text.startswith(TOOL_CALLS, pos):
                pos += len(TOOL_CALLS)
                continue
            keep = 0 if final else held_back(text, pos, (TOOL_CALLS,))
            scan.content += text[pos:len(text) - keep]
            return scan

    @staticmethod
    def _list(text: str, pos: int, scan: Scan) -> int | None:
        """Calls in a JSON list from text[pos] == "[": where the list ends, None while open."""
        pos += 1
        while True:
            pos = skip_whitespace(text, pos)
            if pos >= len(text):
                return None
            if text[pos] == "]":
                return pos + 1
            if text[pos] == ",":
                pos += 1
                continue
            if text[pos] != "{":
                scan.content += text[pos:]
                return None
            call, obj = json_call(text, pos)
            if call is None:
                if obj.end is not None or obj.broken:
                    scan.content += text[pos:]
                return None
            scan.calls.append(call)
            if obj.end is None:
                return None
            pos = obj.end

    @staticmethod
    def _named(text: str, pos: int, scan: Scan, final: bool) -> int | None:
        """One `NAME[ARGS]{...}` call: where it ends, None while open."""
        named = _NAMED.match(text, pos)
        if named is None or named.end() == len(text):
            if final or named is None:
                scan.content += text[pos:]
            return None
        if text[named.end()] != "{":
            if final or not ARGS.startswith(text[named.end():]):
                scan.content += text[pos:]
            return None
        end = json_value_end(text, named.end())
        scan.calls.append(PartialCall(named.group(1), text[named.end():end if end is not None else len(text)],
                                      done=end is not None))
        return end

    def call_grammar(self, tools: Sequence[dict[str, Any]], parallel: bool, spell: Spell) -> str:
        repeat = ' (", " call)*' if parallel else ""
        return "\n".join([f'start: {spell(TOOL_CALLS)} "[" call{repeat} "]"', *json_call_rules(tools, "arguments")])

    def format_call(self, name: str, arguments: str) -> str:
        return f'{TOOL_CALLS}[{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {arguments}}}]'
