"""Per-request sampling parameters, validated up front so bad values fail with a clear message."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from tokenmill.structured_output.params import StructuredOutputsParams

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context limit
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-N alternatives per generated token (the chosen token is always given)
    # vLLM's: the log-probs of every prompt token given the ones before it (and the top-N alternatives), the
    # first one None. Computed during prefill; such a prompt does not read the prefix cache (vLLM's rule too):
    # a cached block has no logits.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Added to the logits of these token ids before penalties and sampling (OpenAI's logit_bias, [-100, 100]).
    logit_bias: dict[int, float] | None = None
    # Constrain the output to a JSON schema, regex, choice or grammar (vLLM's field; a dict is converted).
    structured_outputs: StructuredOutputsParams | None = None
    # An embedding instead of tokens (task "embed"): the request ends after its prompt with its pooled final
    # hidden states (a decoder's last token, as Qwen3-Embedding's; an encoder's pooling), nothing sampled.
    pool: bool = False
    # with pool on a cross-encoder: "classify" gives its classification head's logits instead of the embedding
    pooling_task: str = "embed"

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            fields: dict[str, Any] = self.structured_outputs
            self.structured_outputs = StructuredOutputsParams(**fields)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def fail(message: str) -> None:
            raise ValueError(message)

        if not isinstance(self.n, int) or self.n < 1:
            fail(f"n must be an integer >= 1, got {self.n!r}")
        if not 0.0 <= self.temperature <= 100.0:
            fail(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            fail(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                fail(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            fail(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            fail(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            fail(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids must be non-negative integers")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            fail(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            fail(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if self.pool and (self.n != 1 or self.prompt_logprobs is not None or self.structured_outputs is not None):
            fail("an embedding request (pool) takes no n, prompt_logprobs or structured_outputs")
        if self.pooling_task not in ("embed", "classify"):
            fail(f"pooling_task is embed or classify, got {self.pooling_task!r}")
        for token_id, bias in (self.logit_bias or {}).items():
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                fail(f"logit_bias keys must be token ids (non-negative integers), got {token_id!r}")
            if not -100.0 <= bias <= 100.0:
                fail(f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_seed(self, seed: int | None) -> SamplingParams:
        """A copy for one of n samples (each gets its own seed so the samples differ)."""
        return replace(self, n=1, seed=seed)
