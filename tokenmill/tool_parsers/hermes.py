"""Hermes calls (vLLM's `hermes`: Qwen2.5, Qwen3, Hermes, SmolLM-style templates): one
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` block per call.

Lenient (the default): Qwen2.5 models often drop the tags, writing the bare JSON object, or one in a fenced json
block, as their whole answer; that is a call when it names one of the request's tools (llama.cpp's Qwen handler
accepts the same shapes), and stays content otherwise."""

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
    json_call,
    json_call_rules,
    scan_blocks,
    skip_whitespace,
)

START, END = "<tool_call>", "</tool_call>"
# the start of an answer that may be a loose call: optional fence, then an object
_LOOSE_START = re.compile(r"\s*(?:```(?:json)?\s*)?\{")
_FENCE_END = re.compile(r"\s*```")


class HermesParser(ToolParser):
    name = "hermes"
    markers = (START, END)

    def scan(self, text: str, final: bool) -> Scan:
        if self.lenient and self.tools:
            loose = self._loose(text, final)
            if loose is not None:
                return loose
        return scan_blocks(text, final, START, END, _block)

    def _loose(self, text: str, final: bool) -> Scan | None:
        """A tagless answer: one or more JSON calls (maybe fenced) naming the request's tools. None: it is not
        one (then the tagged reading applies); an empty scan while undecided."""
        match = _LOOSE_START.match(text)
        if match is None:
            undecided = not final and "```json".startswith(text.strip())
            return Scan() if undecided else None
        scan = Scan()
        pos = match.end() - 1
        while True:
            call, obj = json_call(text, pos)
            if obj.broken or (call is not None and call.name not in self.tools):
                return None
            if call is None:
                return None if final or obj.end is not None else Scan()
            scan.calls.append(call)
            if obj.end is None:
                return scan
            following = skip_whitespace(text, obj.end)
            if following < len(text) and text[following] == "{":
                pos = following
                continue
            fence = _FENCE_END.match(text, obj.end)
            rest = text[fence.end() if fence is not None else obj.end:]
            # what may still become the fence's end waits
            if final or (rest.strip() and not "```".startswith(rest.strip())):
                scan.content = rest
            return scan

    def call_grammar(self, tools: Sequence[dict[str, Any]], parallel: bool, spell: Spell) -> str:
        repeat = ' ("\\n" call)*' if parallel else ""
        return "\n".join([f"start: call{repeat}", *json_call_rules(
            tools, "arguments", before=f'{spell(START)} "\\n"', after=f'"\\n" {spell(END)}')])

    def format_call(self, name: str, arguments: str) -> str:
        return f'{START}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {arguments}}}\n{END}'


def _block(text: str, body: int, final: bool) -> tuple[PartialCall | None, int]:
    body = skip_whitespace(text, body)
    call, obj = json_call(text, body)
    # the end tag after the call's object (its strings may hold the tag's text); an open object goes on, a broken
    # one ends at the tag
    end = text.find(END, obj.end if obj.end is not None else body) if obj.end or obj.broken else -1
    if call is not None and end >= 0:
        call.done = True
    return call, end
