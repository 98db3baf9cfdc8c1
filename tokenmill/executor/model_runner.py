"""Plan -> one flat batch -> model -> logits of the rows to sample -> sampler."""

from __future__ import annotations

import random
from typing import Protocol

import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from tokenmill.executor.sampler import Sampler, SamplingRow
from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.llama import LlamaForCausalLM

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Executor(Protocol):
    """What the engine needs from whatever runs the model (a real runner, a fake one in tests, a simulator)."""

    num_kv_blocks: int

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput: ...


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * element


def num_kv_blocks_for(config: EngineConfig, model: ModelConfig) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_bytes_per_block(model, config.block_size, _DTYPES[config.dtype])
    return max(1, int(config.kv_cache_memory_gb * 2**30) // per_block)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        self.device = torch.device(config.device)
        self.dtype = _DTYPES[config.dtype]
        self.block_size = config.block_size
        model = LlamaForCausalLM(model_config)
        model.load_weights(weights)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.num_kv_blocks = num_kv_blocks_for(config, model_config)
        shape = (self.num_kv_blocks, config.block_size, model_config.num_kv_heads, model_config.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(model_config.num_layers)
        ]
        for layer, cache in zip(self.model.decoder_layers, self.kv_caches):
            layer.self_attn.kv_cache = cache
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}
        self._seed_source = random.Random(config.seed)  # seeds for requests that bring none

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator:
        generator = self._generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed if seed is not None else self._seed_source.getrandbits(63))
            self._generators[request_id] = generator
        return generator

    @torch.inference_mode()
    def compute_logits(self, plan: SchedulerOutput) -> tuple[list[ScheduledRequest], torch.Tensor | None]:
        """Run the flat batch; logits [N, vocab] of the requests that sample this step (in plan order)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sampled: list[ScheduledRequest] = []
        for s in plan.scheduled:
            table = s.block_table
            input_ids.extend(s.token_ids)
            span = range(s.start_position, s.start_position + s.num_tokens)
            positions.extend(span)
            slots.extend(table[p // bs] * bs + p % bs for p in span)
            query_lens.append(s.num_tokens)
            seq_lens.append(s.start_position + s.num_tokens)
            tables.append(table)
            if s.sample and not s.padding:
                sample_rows.append(len(input_ids) - 1)
                sampled.append(s)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, slots, bs, self.device)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            meta,
        )
        if not sampled:
            return sampled, None
        return sampled, self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in plan.finished_request_ids:
            self._generators.pop(request_id, None)
        if plan.is_empty:
            return ModelRunnerOutput({})
        sampled, logits = self.compute_logits(plan)
        if logits is None:
            return ModelRunnerOutput({})
        rows = [
            SamplingRow(s.sampling_params, s.prompt_token_ids, s.output_token_ids,
                        None if s.sampling_params.greedy else self._generator(s.request_id, s.sampling_params.seed),
                        s.banned_token_ids)
            for s in sampled
        ]
        result = self.sampler(logits, rows)
        return ModelRunnerOutput(
            sampled_token_ids={s.request_id: t for s, t in zip(sampled, result.token_ids)},
            logprobs={s.request_id: lp for s, lp in zip(sampled, result.logprobs) if lp is not None},
        )
