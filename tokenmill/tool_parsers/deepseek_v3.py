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
    json_value_end,
    quoted,
    scan_blocks,
)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_HEAD = re.compile(r"[^<\n]*<｜tool▁sep｜>([^\n]+)\n```(?:json)?[ \t]*\n")


class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def scan(self, text: str, final: bool) -> Scan:
        return scan_blocks(text, final, CALL_BEGIN, CALL_END, _block, dropped=(CALLS_BEGIN, CALLS_END))

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


def _block(text: str, body: int, final: bool) -> tuple[PartialCall | None, int]:
    """One block's call once its name line is complete, its arguments as far as they go."""
    end = text.find(CALL_END, body)
    block = text[body:end if end >= 0 else len(text)]
    head = _HEAD.match(block)
    if head is None:
        return None, end
    value = head.end()
    name = head.group(1).strip()
    if value >= len(block):
        return PartialCall(name), end
    value_end = json_value_end(block, value)
    return PartialCall(name, block[value:value_end if value_end is not None else len(block)], done=end >= 0), end
