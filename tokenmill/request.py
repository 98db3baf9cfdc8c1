"""A request inside the engine: known tokens, computed tokens, status and event timestamps."""

from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_output.manager import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    """Ordered: everything above PREEMPTED is finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # the request cannot go on (its output broke its grammar): an error to its client

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}.get(self)


@dataclass
class RequestTimes:
    """Event timestamps (time.monotonic seconds); the metrics layer turns them into histograms."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)
    # (step planned, step done, tokens) of every step that computed part of the prompt (traces' prefill chunks)
    prefill_chunks: list[tuple[float, float, int]] = field(default_factory=list)


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), arrival_time: float | None = None, priority: int = 0,
                 prompt: str | None = None, lora_request: LoRARequest | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.lora_request = lora_request  # the adapter it runs under; None: the base model
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # why it ended with FINISHED_ERROR
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache at first scheduling
        self.num_preemptions = 0
        self.num_migrations = 0  # moves off a dead engine core (the front end counts them)
        self.num_recomputed_tokens = 0
        # Set on resumption after preemption; cleared when the request makes progress again (thrash guard).
        self.resumed_without_progress = False
        self.max_total_tokens = 0  # set by the scheduler: prompt + max_tokens capped by the context length
        self.times = RequestTimes(arrival=time.monotonic() if arrival_time is None else arrival_time)
        self.logprobs: list[dict[int, float]] = []  # per output token: token id -> logprob (chosen + top-N)
        # sampling_params.prompt_logprobs: entries for prompt tokens 1.. (the first token has none), filled in
        # as the prompt's chunks are computed
        self.prompt_logprobs: list[dict[int, float]] = []
        self.block_hashes: list[int] = []  # chained hashes of its full blocks (prefix caching)
        # folded into the first block's hash: KV that the same tokens produce differently must not be shared
        # (length-dependent rope scaling, ModelConfig.rope_cache_key)
        self.cache_salt = 0
        # the client's or the server's cache_salt (server/cache_salt.py), folded into cache_salt
        self.user_cache_salt: str | None = None
        # longrope: once the sequence has grown past the original context, every token rotates for at least this
        # length (its KV is recomputed with the long factors, as transformers' Phi-3 does); 0 before
        self.rope_length = 0
        # an encoder's segment ids (BERT's token types: 1 for a cross-encoder pair's second text); None: all 0
        self.token_type_ids: list[int] | None = None
        # Speculative decoding: tokens proposed for the next step (never part of all_token_ids until accepted),
        # and its recent verifications (decaying counts of accepted tokens and of rejections), from which the
        # proposer sizes its proposals (spec_decode/proposer.py).
        self.spec_token_ids: list[int] = []
        self.spec_accepted = 0.0
        self.spec_rejections = 0.0
        self.spec_idle_steps = 0  # steps since it last proposed
        # Structured outputs: its grammar (compiling, then advanced by each emitted token); set by the scheduler.
        self.structured: StructuredOutputRequest | None = None
        # Prefill/decode disaggregation: on a producer {"do_remote_decode": True} (save the prompt's KV when
        # done); on a consumer the connector's parameters to load it from (cleared once loaded).
        self.kv_transfer_params: dict[str, Any] | None = None

    def set_cache_salt(self, rope_key: int) -> None:
        """The prefix-cache salt from what its KV depends on besides its tokens: the rope key
        (ModelConfig.rope_cache_key) and its adapter; and from whom may share it (`user_cache_salt`)."""
        salt = rope_key if self.lora_request is None else hash((rope_key, self.lora_request.cache_salt))
        if self.user_cache_salt is not None:  # a digest: str hashes differ between processes
            digest = hashlib.blake2b(self.user_cache_salt.encode(), digest_size=8).digest()
            salt = hash((salt, int.from_bytes(digest, "little")))
        self.cache_salt = salt

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and not all of them are computed yet."""
        return (self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
