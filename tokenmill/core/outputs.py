"""The plain-data messages between the scheduler and the executor (they could cross a process boundary)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens fed this step (a prompt chunk, or the last sampled token)
    start_position: int  # position of token_ids[0] = tokens already computed before this step
    block_table: list[int]  # physical block ids of the whole sequence
    sample: bool  # sample a next token after the last fed token (the prompt is fully computed)
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far (penalties read it)
    padding: bool = False  # static batching: a finished row that still costs compute; never sampled
    banned_token_ids: list[int] = field(default_factory=list)  # EOS/stop ids masked before min_tokens
    # Speculative decoding: token_ids ends with this many proposed tokens, to verify (sample is then True).
    num_spec_tokens: int = 0
    structured: bool = False  # its sampled rows are masked by the plan's grammar bitmask
    score_prompt: bool = False  # prompt logprobs wanted: score the prompt tokens this chunk predicts
    lora_request: LoRARequest | None = None  # the adapter its rows run under (None: the base model)
    rope_length: int = 0  # longrope: the least length its tokens rotate for (Request.rope_length)
    token_type_ids: list[int] | None = None  # an encoder's segment ids for token_ids (Request.token_type_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that ended since the previous plan: the executor drops its per-request state for them.
    finished_request_ids: list[str] = field(default_factory=list)
    # Structured outputs: int32 token bitmask rows (bit set = allowed) for the logits rows of the structured
    # requests that sample, in plan order (1 + num_spec_tokens rows each).
    grammar_bitmask: torch.Tensor | None = None
    planned_at: float = 0.0  # when the scheduler made it (the scheduler's clock)

    @property
    def total_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int]
    # per sampled request: token id -> logprob for the chosen token and its top-N alternatives
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    # speculative decoding: the proposed tokens accepted before the sampled one (and their logprobs)
    accepted_token_ids: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    # prompt logprobs of this step's prompt chunks: request id -> (the position of the first token they score,
    # one entry per scored prompt token)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)
    # pooling requests (SamplingParams.pool) whose prompt ended this step: the last token's final hidden state
    pooled: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """What one step did to one request: new tokens and, at the end, why it finished."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a producer's saved KV, for the decode engine
    prompt_logprobs: list[dict[int, float]] | None = None  # with the first token: prompt tokens 1.. scored
    pooled: list[float] | None = None  # a pooling request's embedding, with its end
    error: str | None = None  # finish_reason "error": why the request could not go on


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    kv_tokens: int = 0  # tokens whose KV is held by running requests
    kv_reserved_tokens: int = 0  # slots in the blocks those requests hold
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_generated_tokens: int = 0  # sampled this step (set after the step)
    num_padding_tokens: int = 0
    num_preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    # speculative decoding, this step (set after the step): proposals verified, their tokens, accepted ones
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_rejections: int = 0  # proposals not accepted in full
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    # --target-itl-ms: the prompt tokens this step was allowed; after the step, its seconds, how far the
    # predictor was off (measured - predicted), and whether it ran over the target with decodes running
    prompt_budget: int | None = None
    step_seconds: float | None = None
    prediction_error: float | None = None
    over_target: bool = False
    # multi-LoRA: the adapters of the running and of the waiting requests (None: the engine serves none)
    running_loras: list[str] | None = None
    waiting_loras: list[str] | None = None
    max_loras: int = 0
    # the KV tiers under the pool (kv_offload/store.py: KVTierStore.counters), cumulative; None: no tiers
    kv_tiers: dict[str, float] | None = None


@dataclass
class StepRecord:
    """Per-step stats: what was scheduled, how long it took, the state of queues and KV."""

    step: int
    seconds: float
    stats: SchedulerStats
    plan: SchedulerOutput | None = None  # what the step ran (read by step traces)
    started: float = 0.0  # time.perf_counter() at its start
