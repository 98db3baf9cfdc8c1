"""LLMEngine: tokenizer + engine core + output processor, stepped by the caller."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.core import EngineCore
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.executor.model_runner import Executor, ModelRunner
from tokenmill.model.loader import LoadedModel, load_model
from tokenmill.model.tokenizer import Tokenizer
from tokenmill.outputs import RequestOutput
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_output.manager import StructuredOutputManager

# A prompt is text, a list of token ids, or {"prompt": str} / {"prompt_token_ids": [...]}.
PromptType = str | Sequence[int] | dict[str, Any]


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, executor: Executor, max_model_len: int,
                 eos_token_ids: tuple[int, ...], vocab_size: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.structured_output = StructuredOutputManager(tokenizer.backend, vocab_size, eos_token_ids)
        self.core = EngineCore(config, executor, max_model_len, clock, self.structured_output)
        self.output_processor = OutputProcessor(tokenizer)
        self.clock = clock
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        loaded = load_model(config.model)
        return cls.from_loaded(config, loaded, Tokenizer.from_path(loaded.path, loaded.gguf_reader))

    @classmethod
    def from_loaded(cls, config: EngineConfig, loaded: LoadedModel, tokenizer: Tokenizer) -> LLMEngine:
        """An engine over weights already in memory (benchmarks and tests build several from one load)."""
        runner = ModelRunner(config, loaded.config, loaded.weights)
        model_len = loaded.config.max_position_embeddings
        max_model_len = min(config.max_model_len or model_len, model_len)
        eos = set(loaded.config.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        return cls(config, tokenizer, runner, max_model_len, tuple(sorted(eos)), loaded.config.vocab_size)

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

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

    def make_requests(
        self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None,
        priority: int = 0, strict_max_tokens: bool = False,
    ) -> tuple[str | None, list[int], list[Request]]:
        """Tokenize and validate; one engine request per sample (n > 1 fans out with seeds seed, seed+1, ...).

        Raises ValueError for anything that could never run, before any engine state changes. With
        `strict_max_tokens` (the server's rule, as vLLM's), prompt + max_tokens beyond the context is an error;
        otherwise (offline, as vLLM's LLM) generation stops at the context limit.
        """
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
            children = [Request(request_id, token_ids, params, self.eos_token_ids, arrival, priority, text)]
        else:
            children = [
                Request(f"{request_id}#{i}", token_ids,
                        params.with_seed(None if params.seed is None else params.seed + i),
                        self.eos_token_ids, arrival, priority, text)
                for i in range(params.n)
            ]
        for child in children:
            self.core.scheduler.check_request(child)
        return text, token_ids, children

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> str:
        request_id = request_id if request_id is not None else str(next(self._ids))
        text, token_ids, children = self.make_requests(request_id, prompt, params or SamplingParams(),
                                                       arrival_time, priority)
        added: list[str] = []
        try:
            for child in children:
                self.core.add_request(child)
                added.append(child.request_id)
        except ValueError:
            self.core.abort_requests(added)
            raise
        self.output_processor.add(request_id, text, token_ids, children)
        return request_id

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            self.core.abort_requests(self.output_processor.child_ids(request_id))
            self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        core_outputs = self.core.step()
        outputs, stopped = self.output_processor.process(core_outputs)
        if stopped:
            self.core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs
