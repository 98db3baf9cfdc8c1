"""An output's parts as every API shapes them: the reasoning (with --reasoning-parser), the answer's text and its
tool calls, whole or delta by delta. Each API module turns the parts into its own blocks, items or events."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tokenmill.outputs import RequestOutput
from tokenmill.reasoning import ReasoningParser, ReasoningStreamer
from tokenmill.tool_parsers import ToolCall, ToolCallStreamer, ToolParser


@dataclass
class Part:
    """reasoning / text: a piece of either; call: a tool call begins (`text` is its function's name);
    arguments: a piece of the open call's arguments (JSON text)."""

    kind: Literal["reasoning", "text", "call", "arguments"]
    text: str


def split_output(text: str, reasoning: ReasoningParser | None,
                 tools: ToolParser | None) -> tuple[str | None, str | None, list[ToolCall]]:
    """(reasoning or None, the answer's text or None, its tool calls) of a whole output."""
    thought = None
    answer: str | None = text
    if reasoning is not None:
        thought, answer = reasoning.split(text)
    calls: list[ToolCall] = []
    if tools is not None:
        answer, calls = tools.parse(answer or "")
    return thought, answer, calls


class OutputSplitter:
    """The parts of an output, delta by delta, in order (what may still be a tag is held back until known)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self.thoughts = ReasoningStreamer(reasoning) if reasoning is not None else None
        self.calls = ToolCallStreamer(tools) if tools is not None else None

    @property
    def called(self) -> bool:
        return self.calls is not None and self.calls.called

    def feed(self, delta: str, final: bool) -> list[Part]:
        parts: list[Part] = []
        if self.thoughts is not None:
            thought, delta = self.thoughts.feed(delta, final)
            if thought:
                parts.append(Part("reasoning", thought))
        if self.calls is None:
            return parts + ([Part("text", delta)] if delta else [])
        content, calls = self.calls.feed(delta, final=final)
        if content:
            parts.append(Part("text", content))
        for call in calls:
            if "id" in call:  # a new call: its name is known
                parts.append(Part("call", call["function"]["name"]))
            if call["function"].get("arguments"):
                parts.append(Part("arguments", call["function"]["arguments"]))
        return parts


class PartEvents:
    """A builder whose stream is its output's parts turned into events: it says what each part becomes."""

    parts: OutputSplitter
    finish_reason: str | None

    def update(self, prompt_index: int, output: RequestOutput) -> RequestOutput:
        raise NotImplementedError

    def part_events(self, part: Part) -> list[str]:
        raise NotImplementedError

    def delta_events(self, prompt_index: int, output: RequestOutput) -> list[str]:
        delta = output.outputs[0].delta_text
        self.update(prompt_index, output)
        events: list[str] = []
        for part in self.parts.feed(delta, final=self.finish_reason is not None):
            events += self.part_events(part)
        return events
