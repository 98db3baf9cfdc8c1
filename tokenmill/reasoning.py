"""Reasoning output (`--reasoning-parser`, vLLM's flag): the `<think>...</think>` block a reasoning model writes
before its answer, split from the answer, whole or delta by delta.

- deepseek_r1 (DeepSeek-R1 and its distills): the chat template opens the block, so the output may start inside
  it without the start tag; output with no end tag is all reasoning.
- qwen3 (Qwen3, QwQ): the model opens the block itself; output that does not start with it is all answer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_inside: bool  # the output begins inside the reasoning block (its start tag is in the prompt)
    start: str = "<think>"
    end: str = "</think>"

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, answer) of a whole output; reasoning None when the output has none."""
        stripped = text.lstrip()
        opened = stripped.startswith(self.start)
        if not (opened or self.starts_inside):
            return None, text
        body = stripped[len(self.start):] if opened else text
        end = body.find(self.end)
        if end < 0:
            return body, ""
        return body[:end], body[end + len(self.end):]


REASONING_PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_inside=True),
    "qwen3": ReasoningParser("qwen3", starts_inside=False),
}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}: one of {', '.join(REASONING_PARSERS)}") from None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (it may be a tag being written)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStreamer:
    """Splits an output delta by delta: what a tag may still turn out to be is held back, so the deltas always
    add up to `split` of the text so far, and to `split` of the whole output once `final`."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.reasoning_sent = 0
        self.answer_sent = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(reasoning delta, answer delta)."""
        self.text += delta
        text = self.text
        if not final:
            stripped = text.lstrip()
            if len(stripped) < len(self.parser.start) and self.parser.start.startswith(stripped):
                return "", ""  # nothing yet, or the start tag being written: which part it is is not known
            if self.parser.end not in text:  # (in an answer without reasoning this only delays a few characters)
                text = text[:len(text) - _partial_suffix(text, self.parser.end)]
        reasoning, answer = self.parser.split(text)
        reasoning_delta = (reasoning or "")[self.reasoning_sent:]
        answer_delta = answer[self.answer_sent:]
        self.reasoning_sent += len(reasoning_delta)
        self.answer_sent += len(answer_delta)
        return reasoning_delta, answer_delta
