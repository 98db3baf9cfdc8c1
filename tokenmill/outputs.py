"""What users get back (the shape of vLLM's RequestOutput / CompletionOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    # This step's increment, for streaming.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    prefill_chunks: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end, tokens) per step
    num_migrations: int = 0  # moves off a dead engine core


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: one entry per prompt token (token id -> logprob: the prompt's token and
    # the top-N), the first None; set once the prompt is computed
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: list[RequestMetrics] = field(default_factory=list)  # one per completion (n > 1)
    pooled: list[float] | None = None  # SamplingParams.pool: the prompt's last-token hidden state


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """vLLM's EmbeddingRequestOutput: `outputs.embedding`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    finished: bool = True
