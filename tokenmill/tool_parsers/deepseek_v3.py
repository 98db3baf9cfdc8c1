"""DeepSeek-V3 / R1 calls (vLLM's `deepseek_v3`): content, then the calls between DeepSeek's own marker tokens,

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

one `<｜tool▁call▁begin｜>` block per call."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from tokenmill.tool_parsers.base import (
    PartialCall,
    Scan,
    Spell,
    ToolParser,
    alternatives,
    arguments_rule,
    held_back,
    json_value_end,
    quoted,
)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_HEAD = re.compile(r"[^<\n]*<｜tool▁sep｜>([^\n]+)\n```(?:json)?[ \t]*\n")
_BETWEEN = re.compile(r"\s*(?:<｜tool▁calls▁end｜>)?")


class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def scan(self, text: str, final: bool) -> Scan:
        begin = text.find(CALLS_BEGIN)
        if begin < 0:
            return Scan(content=text[:len(text) - (0 if final else held_back(text, 0, (CALLS_BEGIN,)))])
        scan = Scan(content=text[:begin])
        pos = begin + len(CALLS_BEGIN)
        while True:
            start = text.find(CALL_BEGIN, pos)
            if start < 0:
                between = _BETWEEN.match(text, pos)
                rest = text[between.end():]  # type: ignore[union-attr]  # matches any text
                if final or not (CALL_BEGIN.startswith(rest) or CALLS_END.startswith(rest.lstrip())):
                    scan.content += rest
                return scan
            end = text.find(CALL_END, start)
            block = text[start + len(CALL_BEGIN):end if end >= 0 else len(text)]
            call = _call(block)
            if end < 0:
                if call is not None:
                    scan.calls.append(call)
                elif final and not scan.calls:  # cut short before its name: after calls it is dropped
                    scan.content += text[start:]
                return scan
            if call is None:
                scan.content += text[start:end + len(CALL_END)]
            else:
                call.done = True
                scan.calls.append(call)
            pos = end + len(CALL_END)

    def call_grammar(self, tools: Sequence[dict[str, Any]], parallel: bool, spell: Spell) -> str:
        rules = []
        for i, tool in enumerate(tools):
            rules.append(f"call_{i}: {spell(CALL_BEGIN)} \"function\" {spell(SEP)} "
                         f"{quoted(tool['name'] + chr(10) + '```json' + chr(10))} args_{i} "
                         f"{quoted(chr(10) + '```')} {spell(CALL_END)}")
            rules.append(arguments_rule(f"args_{i}", tool))
        repeat = " call*" if parallel else ""
        return "\n".join([f"start: {spell(CALLS_BEGIN)} call{repeat} {spell(CALLS_END)}",
                          "call: " + alternatives([f"call_{i}" for i in range(len(tools))]), *rules])

    def format_call(self, name: str, arguments: str) -> str:
        return (f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}{CALLS_END}")


def _call(block: str) -> PartialCall | None:
    """One block's call once its name line is complete; its arguments as far as they go."""
    head = _HEAD.match(block)
    if head is None:
        return None
    value = head.end()
    if value >= len(block):
        return PartialCall(head.group(1).strip())
    end = json_value_end(block, value)
    return PartialCall(head.group(1).strip(), block[value:end if end is not None else len(block)])
