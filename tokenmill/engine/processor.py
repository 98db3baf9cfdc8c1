"""Input processing on the front end: a prompt becomes validated engine requests, before any engine sees it.

It needs the tokenizer, the model's limits and the KV pool's size, not the weights, so an API server process
can run it while the engine cores (threads or processes) hold the model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.core.scheduler import check_request_fits
from tokenmill.encoder.front import EncoderFront
from tokenmill.lora.request import LoRARequest
from tokenmill.model.tokenizer import Tokenizer
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_output.manager import StructuredOutputManager

# A prompt is text, a list of token ids, or {"prompt": str} / {"prompt_token_ids": [...]}.
PromptType = str | Sequence[int] | dict[str, Any]


def model_limits(model: ModelConfig, tokenizer: Tokenizer, config: EngineConfig) -> tuple[int, tuple[int, ...]]:
    """(max_model_len, EOS token ids) for a model: the configured length capped by the model's, and every id the
    model config or the tokenizer names as end of sequence."""
    eos = set(model.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return max_model_len_of(model, config), tuple(sorted(eos))


def max_model_len_of(model: ModelConfig, config: EngineConfig) -> int:
    """The configured length capped by the model's."""
    return min(config.max_model_len or model.max_context_len, model.max_context_len)


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, max_model_len: int,
                 eos_token_ids: tuple[int, ...], vocab_size: int, kv_capacity_tokens: int,
                 structured_output: StructuredOutputManager | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 cache_salt_of: Callable[[int], int] | None = None, model_config: ModelConfig | None = None,
                 encoder: EncoderFront | None = None) -> None:
        self.config = config
        self.model_config = model_config  # the model's shape (the server checks adapters against it)
        self.encoder = encoder  # an encoder's front (its tokenizer for pairs, its pooling), or None: a decoder
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.kv_capacity_tokens = kv_capacity_tokens  # the smallest replica's KV pool, in tokens
        self.structured_output = structured_output or StructuredOutputManager(
            lambda: (tokenizer.backend, eos_token_ids), vocab_size)
        self.clock = clock
        self.cache_salt_of = cache_salt_of  # prompt length -> prefix-cache salt (ModelConfig.rope_cache_key)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        return None, list(prompt)

    def _token_type_ids(self, prompt: PromptType, params: SamplingParams, num_tokens: int) -> list[int] | None:
        """An encoder's segment ids, checked; an encoder takes embedding requests only (its runner computes
        nothing else), a decoder no segment ids."""
        token_type_ids = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
        if self.encoder is None:
            if token_type_ids is not None:
                raise ValueError("token_type_ids are an encoder's input: this model is a decoder")
            return None
        if not params.pool:
            raise ValueError("this model is an encoder: it serves embeddings, rerank and scores, not generation")
        if token_type_ids is None:
            return None
        types = [int(t) for t in token_type_ids]
        if len(types) != num_tokens or not all(0 <= t < self.encoder.config.type_vocab_size for t in types):
            raise ValueError(f"token_type_ids: one per prompt token, each in [0, "
                             f"{self.encoder.config.type_vocab_size})")
        return types

    def make_requests(
        self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None,
        priority: int = 0, strict_max_tokens: bool = False, lora_request: LoRARequest | None = None,
    ) -> tuple[str | None, list[int], list[Request]]:
        """Tokenize and validate; one engine request per sample (n > 1 fans out with seeds seed, seed+1, ...).
        `lora_request`: the adapter the request runs under (the engine needs --enable-lora).

        Raises ValueError for anything that could never run, before any engine state changes. With
        `strict_max_tokens` (the server's rule, as vLLM's), prompt + max_tokens beyond the context is an error;
        otherwise (offline, as vLLM's LLM) generation stops at the context limit.
        """
        if lora_request is not None and not self.config.enable_lora:
            raise ValueError("this engine serves no LoRA adapters (start it with --enable-lora)")
        text, token_ids = self.tokenize_prompt(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        out_of_vocab = [t for t in params.logit_bias or {} if t >= self.vocab_size]
        if out_of_vocab:
            raise ValueError(f"logit_bias token ids out of range [0, {self.vocab_size}): {out_of_vocab[:5]}")
        if params.structured_outputs is not None:
            self.structured_output.validate(params.structured_outputs)
        wanted = len(token_ids) + (params.max_tokens or 0)
        if strict_max_tokens and params.max_tokens is not None and wanted > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{wanted} tokens ({len(token_ids)} in the prompt, {params.max_tokens} in the completion). "
                f"Please reduce the length of the prompt or completion."
            )
        arrival = self.clock() if arrival_time is None else arrival_time
        if params.n == 1:
            children = [Request(request_id, token_ids, params, self.eos_token_ids, arrival, priority, text,
                                lora_request)]
        else:
            children = [
                Request(f"{request_id}#{i}", token_ids,
                        # the prompt is the same for all: the first sample alone scores it, the others may
                        # then read the prefix cache
                        replace(params.with_seed(None if params.seed is None else params.seed + i),
                                prompt_logprobs=params.prompt_logprobs if i == 0 else None),
                        self.eos_token_ids, arrival, priority, text, lora_request)
                for i in range(params.n)
            ]
        token_type_ids = self._token_type_ids(prompt, params, len(token_ids))
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError("cache_salt must be a non-empty string")
        for child in children:
            # KV computed under an adapter, or rotated for a length, or salted, is shared only with the same
            child.user_cache_salt = salt
            child.token_type_ids = token_type_ids
            child.set_cache_salt(0 if self.cache_salt_of is None else self.cache_salt_of(len(token_ids)))
            check_request_fits(child, self.max_model_len, self.kv_capacity_tokens, self.config.batching == "static")
        return text, token_ids, children
