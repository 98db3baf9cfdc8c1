"""Streaming over any parser: each delta re-scans the output so far and sends what is new, so that whatever the
chunking (a character at a time, or a whole call at once as speculative decoding delivers it) the deltas add up
to the whole parse: the same content (whitespace at its ends held back) and the same calls, ids stable."""

from __future__ import annotations

from typing import Any

from tokenmill.tool_parsers.base import ToolParser, new_call_id


class ToolCallStreamer:
    """Output text, delta by delta -> content deltas and OpenAI tool-call deltas (a call's id, type and name once
    its name is complete, then its arguments in pieces)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.content_sent = 0  # characters of the scan's content sent (after its leading whitespace)
        self.content_start: int | None = None  # where the content's first non-space character is
        self.ids: list[str] = []  # the calls announced
        self.arguments_sent: list[int] = []

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        scan = self.parser.scan(self.text, final)
        return self._content(scan.content), self._call_deltas(scan)

    def _content(self, content: str) -> str:
        if self.content_start is None:
            stripped = len(content) - len(content.lstrip())
            if stripped == len(content):
                return ""
            self.content_start = self.content_sent = stripped
        # trailing whitespace waits: it is sent once more content follows it, never at the end
        end = len(content.rstrip())
        if end <= self.content_sent:
            return ""
        piece = content[self.content_sent:end]
        self.content_sent = end
        return piece

    def _call_deltas(self, scan: Any) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(scan.calls):
            if index == len(self.ids):
                self.ids.append(new_call_id())
                self.arguments_sent.append(0)
                deltas.append({"index": index, "id": self.ids[index], "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            if len(call.arguments) > self.arguments_sent[index]:
                deltas.append({"index": index, "function": {"arguments": call.arguments[self.arguments_sent[index]:]}})
                self.arguments_sent[index] = len(call.arguments)
        return deltas

    @property
    def called(self) -> bool:
        return bool(self.ids)
