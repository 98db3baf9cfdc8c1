"""LLMEngine: tokenizer + engine core + output processor, stepped by the caller."""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import time
from collections.abc import Callable, Sequence

from tokenizers import Tokenizer as HFTokenizer

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.core.scheduler import Scheduler
from tokenmill.encoder.front import EncoderFront, serves_encoder
from tokenmill.engine.core import EngineCore
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.processor import InputProcessor, PromptType, max_model_len_of, model_limits
from tokenmill.executor.model_runner import Executor, ModelRunner
from tokenmill.lora.request import LoRARequest
from tokenmill.model.loader import LoadedModel, load_model
from tokenmill.model.tokenizer import Tokenizer
from tokenmill.outputs import RequestOutput
from tokenmill.reasoning import reasoning_parser
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_output.manager import StructuredOutputManager


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, executor: Executor, max_model_len: int,
                 eos_token_ids: tuple[int, ...], vocab_size: int,
                 clock: Callable[[], float] = time.monotonic,
                 cache_salt_of: Callable[[int], int] | None = None, model_config: ModelConfig | None = None,
                 encoder: EncoderFront | None = None) -> None:
        self.config = config
        self.structured_output = StructuredOutputManager(lambda: (tokenizer.backend, eos_token_ids), vocab_size)
        self.core = EngineCore(config, executor, max_model_len, clock, self.structured_output,
                               reasoning_tags(config, lambda: tokenizer))
        self.output_processor = OutputProcessor(tokenizer)
        self.processor = InputProcessor(config, tokenizer, max_model_len, eos_token_ids, vocab_size,
                                        self.core.kv.num_blocks * self.core.kv.block_size, self.structured_output,
                                        clock, cache_salt_of, model_config, encoder)
        self.clock = clock
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        if serves_encoder(config):
            return cls.for_encoder(config)
        loaded = load_model(config.model)
        # the tokenizer is built (Python, Rust) while the weights load (native code, the GIL released)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            tokenizer = pool.submit(Tokenizer.from_path, loaded.path, loaded.gguf_reader, config.chat_template)
            runner = ModelRunner(config, loaded.config, loaded.weights)
            return cls._over_runner(config, loaded, tokenizer.result(), runner)

    @classmethod
    def for_encoder(cls, config: EngineConfig) -> LLMEngine:
        """An encoder's engine: embedding requests only, each input admitted whole (encoder/loader.py)."""
        from tokenmill.encoder.loader import encoder_core_parts

        front, runner, core_config = encoder_core_parts(config)
        return cls(core_config, front.tokenizer.as_tokenizer(), runner, front.max_model_len, (),
                   front.config.vocab_size, encoder=front)

    @classmethod
    def from_loaded(cls, config: EngineConfig, loaded: LoadedModel, tokenizer: Tokenizer) -> LLMEngine:
        """An engine over weights already in memory (benchmarks and tests build several from one load)."""
        return cls._over_runner(config, loaded, tokenizer, ModelRunner(config, loaded.config, loaded.weights))

    @classmethod
    def _over_runner(cls, config: EngineConfig, loaded: LoadedModel, tokenizer: Tokenizer,
                     runner: ModelRunner) -> LLMEngine:
        max_model_len, eos = model_limits(loaded.config, tokenizer, config)
        engine = cls(config, tokenizer, runner, max_model_len, eos, loaded.config.vocab_size,
                     cache_salt_of=loaded.config.rope_cache_key, model_config=loaded.config)
        _warm_start_token_budget(engine.core, config, loaded.config)
        return engine

    @property
    def tokenizer(self) -> Tokenizer:
        return self.processor.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.processor.max_model_len

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.processor.eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.processor.vocab_size

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return self.processor.tokenize_prompt(prompt)

    def make_requests(
        self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None,
        priority: int = 0, strict_max_tokens: bool = False, lora_request: LoRARequest | None = None,
    ) -> tuple[str | None, list[int], list[Request]]:
        """See InputProcessor.make_requests."""
        return self.processor.make_requests(request_id, prompt, params, arrival_time, priority, strict_max_tokens,
                                            lora_request)

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> str:
        request_id = request_id if request_id is not None else str(next(self._ids))
        text, token_ids, children = self.make_requests(request_id, prompt, params or SamplingParams(),
                                                       arrival_time, priority, lora_request=lora_request)
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


def engine_core_from_config(config: EngineConfig) -> EngineCore:
    """The engine core alone, for an engine-core process (its front end tokenizes and detokenizes). The core
    reads its tokenizer only when it needs it: now for a reasoning parser's tags, otherwise at its first grammar
    compile. Reading it holds the GIL (0.3 s for a 151k vocabulary), which the weights' load, in the same
    process, would wait for. An encoder's core runs its inputs through an EncoderRunner."""
    if serves_encoder(config):
        from tokenmill.encoder.loader import encoder_core

        return encoder_core(config)
    loaded = load_model(config.model)
    runner = ModelRunner(config, loaded.config, loaded.weights)
    model = loaded.config
    tokenizer = functools.cache(functools.partial(Tokenizer.from_path, loaded.path, loaded.gguf_reader,
                                                  config.chat_template))

    def vocabulary() -> tuple[HFTokenizer, tuple[int, ...]]:
        return tokenizer().backend, model_limits(model, tokenizer(), config)[1]

    core = EngineCore(config, runner, max_model_len_of(model, config), time.monotonic,
                      StructuredOutputManager(vocabulary, model.vocab_size), reasoning_tags(config, tokenizer))
    _warm_start_token_budget(core, config, model)
    return core


def reasoning_tags(config: EngineConfig, tokenizer: Callable[[], Tokenizer]) -> tuple[list[int], list[int]] | None:
    """The token ids of the configured reasoning parser's start and end tags; None without a parser."""
    parser = reasoning_parser(config.reasoning_parser)
    if parser is None:
        return None
    return (tokenizer().encode(parser.start, add_special_tokens=False),
            tokenizer().encode(parser.end, add_special_tokens=False))


def _warm_start_token_budget(core: EngineCore, config: EngineConfig, model: ModelConfig) -> None:
    """Seed the self-setting token budget's step-cost predictor from a calibrated profile, if one is given."""
    token_budget = core.scheduler.token_budget
    if token_budget is not None and config.step_cost_profile is not None:
        from tokenmill.sim.cost_model import chunks_seconds
        from tokenmill.sim.specs import HardwareProfile, spec_of

        profile, spec = HardwareProfile.load(config.step_cost_profile), spec_of(model)
        token_budget.warm_start(lambda chunks: chunks_seconds(chunks, spec, profile))
