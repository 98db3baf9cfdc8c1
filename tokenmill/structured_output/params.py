"""What a request asks its output to match: vLLM's `StructuredOutputsParams` (one constraint per request)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None  # a JSON schema (as an object or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # a Lark grammar or a llama.cpp GBNF grammar
    json_object: bool | None = None  # any JSON object
    # Accepted for vLLM compatibility; tokenmill never lets the model choose free whitespace inside JSON (see
    # docs/ARCHITECTURE.md: a small model can loop on newlines until max_tokens and never close the object).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(given) > 1:
            raise ValueError(f"only one kind of structured outputs constraint can be used, got {given}")
        if not given:
            raise ValueError(f"a structured outputs constraint needs one of {list(_KINDS)}")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) for c in self.choice)):
            raise ValueError("structured outputs choice must be a non-empty list of strings")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured outputs json must be a JSON schema (an object or its text)")

    @property
    def kind(self) -> str:
        return next(kind for kind in _KINDS if getattr(self, kind) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, text): requests with equal keys share one compiled grammar. Key order is kept: properties are
        generated in the schema's order (as OpenAI's structured outputs do)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from exc
        text = value if isinstance(value, str) else json.dumps(value)
        return kind, text
