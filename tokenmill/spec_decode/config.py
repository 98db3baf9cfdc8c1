"""`--speculative-config` in vLLM's shape: {"method": "ngram", "num_speculative_tokens": 4, ...}."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    # n-gram prompt lookup: match the last n tokens, n from max down to min
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # method "draft_model": the draft (a GGUF file or HF directory with the target's tokenizer; None: the bundled
    # model) and its linear layers' mode (e.g. int8 drafting for a float32 target)
    model: str | None = None
    quantization: str = "auto"
    # no speculation while this many requests (or more) are running: the batch already fills the machine
    disable_by_batch_size: int | None = None
    # per request: no proposals while its per-token acceptance estimate is below this, whatever the step cost
    # model says (proposer.py sizes proposals by the cost of a row and the request's acceptance)
    min_acceptance_rate: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative method must be 'ngram' or 'draft_model', got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.quantization not in ("auto", "none", "int8", "bf16"):
            raise ValueError(f"the draft's quantization must be auto, none, int8 or bf16, got {self.quantization!r}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be >= 1")
        if not 0.0 <= self.min_acceptance_rate <= 1.0:
            raise ValueError("min_acceptance_rate must be in [0, 1]")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a config, a dict (LLM(speculative_config=...)) or a JSON string (the CLI flag)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--speculative-config is not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"unknown speculative_config keys: {sorted(unknown)}")
        return cls(**value)
