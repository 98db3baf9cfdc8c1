"""Plan -> one flat batch -> model -> logits of the rows to sample -> sampler."""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Mapping
from typing import Protocol

import numpy as np
import torch

from tokenmill import kernels
from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from tokenmill.executor.cuda_graphs import (
    MAX_CAPTURED_BATCH,
    Capture,
    CudaGraphCapture,
    DecodeGraphs,
    capture_sizes,
    eager_reason,
)
from tokenmill.executor.sampler import Sampler, SamplingRow, logprob_entries, logprob_entry, random_probs
from tokenmill.kernels import triton_ops
from tokenmill.lora.manager import LoRAManager
from tokenmill.lora.request import LoRARequest
from tokenmill.model.attention import AttentionMetadata, allocate_layer_kv
from tokenmill.model.kv_quant import KVFormat, kv_format
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.metadata import resolve_model_path
from tokenmill.model.quant import resolve_quantization
from tokenmill.platform import cpu_flags
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.rejection import verify_greedy, verify_random
from tokenmill.structured_output.bitmask import apply_bitmask

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SCORE_ROWS = 256  # prompt rows scored at once (their logits are held at vocabulary size meanwhile)
PromptEntries = list[dict[int, float]]
PromptLogprobs = dict[str, tuple[int, PromptEntries]]


class Executor(Protocol):
    """What the engine needs from whatever runs the model (a real runner, a fake one in tests, a simulator)."""

    num_kv_blocks: int

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput: ...


def kv_bytes_per_block(model: ModelConfig, block_size: int, fmt: KVFormat) -> int:
    """Bytes of one block over all layers: K and V values, and their scales in an 8-bit format."""
    return 2 * model.num_layers * block_size * model.num_kv_heads * fmt.bytes_per_token_head(model.head_dim)


def linear_mode(config: EngineConfig) -> str:
    """The resolved quantization of the linear layers. Quantized linears keep float32 activations, so --dtype
    float16/bfloat16 (the whole model in that dtype) takes the unquantized path."""
    if config.dtype != "float32" and config.quantization != "none":
        if config.quantization != "auto":
            raise ValueError(f"--quantization {config.quantization} needs --dtype float32 (activations stay "
                             f"float32; the weights carry the reduced precision)")
        return "none"
    return resolve_quantization(config.quantization, config.device,
                                gguf_weights=resolve_model_path(config.model).endswith(".gguf"))


def kv_cache_format(config: EngineConfig, model: ModelConfig) -> KVFormat:
    """--kv-cache-dtype resolved. `auto`: bf16 under quantized linears where the native attention kernel reads
    bf16 caches (half the bytes a decode step reads; top-1 agreement with float32 moved 97.48% -> 97.42% on the
    quality gate), else the model's dtype, so `--quantization none` stays exact. 8-bit formats are explicit
    (docs/BENCHMARKS.md, "KV cache dtypes": what they measure against bf16 here)."""
    device = torch.device(config.device)
    if config.kv_cache_dtype != "auto":
        fmt = kv_format(config.kv_cache_dtype)
        if fmt.scaled and device.type not in ("cpu", "cuda"):
            raise ValueError(f"--kv-cache-dtype {config.kv_cache_dtype} runs on cpu and cuda, not {device.type}; "
                             f"choices there: float32, bfloat16, float16")
        return fmt
    native_bf16 = ((device.type == "cpu" and kernels.bf16_cache_supported(model.head_dim, config.block_size))
                   or triton_ops.attention_kernel_serves(device, model.head_dim, config.block_size))
    return kv_format("bfloat16" if linear_mode(config) != "none" and native_bf16 else config.dtype)


def lora_dtype(config: EngineConfig) -> torch.dtype:
    """--lora-dtype resolved. `auto`: bfloat16 under quantized linears (half the bytes a decode step reads per
    resident adapter; the arithmetic stays float32), else the model's dtype, so `--quantization none` stays
    exact with PEFT."""
    if config.lora_dtype != "auto":
        return _DTYPES[config.lora_dtype]
    return torch.bfloat16 if linear_mode(config) != "none" else _DTYPES[config.dtype]


def num_kv_blocks_for(config: EngineConfig, model: ModelConfig) -> int:
    """An explicit block count, else on a GPU what --gpu-memory-utilization leaves once the weights are loaded,
    else --kv-cache-memory-gb."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_bytes_per_block(model, config.block_size, kv_cache_format(config, model))
    device = torch.device(config.device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(1, gpu_kv_budget(free, total, config, model) // per_block)
    return max(1, int(config.kv_cache_memory_gb * 2**30) // per_block)


def gpu_kv_budget(free: int, total: int, config: EngineConfig, model: ModelConfig) -> int:
    """Bytes for the KV pool on a GPU (vLLM's rule, with the peak activations estimated rather than profiled):
    `gpu_memory_utilization` of the device, less what is already in use (weights, CUDA context, other processes),
    less a step's activations: the flat batch's hidden states and the logits of the rows that sample or score,
    and the CUDA graphs' pool."""
    in_use = total - free
    logit_rows = max(config.max_num_seqs, SCORE_ROWS)
    width = max(model.hidden_size, model.intermediate_size)
    activations = 2**28 + 16 * config.max_num_batched_tokens * width * 4 + 2 * logit_rows * model.vocab_size * 4
    if not config.enforce_eager:  # the decode graphs' own memory pool: the largest captured batch's activations
        activations += 16 * min(config.max_num_seqs, MAX_CAPTURED_BATCH) * width * 4
    return max(0, int(total * config.gpu_memory_utilization) - in_use - activations)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, weights: Mapping[str, torch.Tensor]) -> None:
        self.device = torch.device(config.device)
        self.dtype = _DTYPES[config.dtype]
        self.block_size = config.block_size
        self.quantization = linear_mode(config)
        self.kv_format = kv_cache_format(config, model_config)
        logger.info("linear layers: %s (--quantization %s), KV cache %s, %d threads", self.quantization,
                    config.quantization, self.kv_format.name, torch.get_num_threads())
        if self.device.type == "cpu":
            logger.info(kernels.prepare())
        model = LlamaForCausalLM(model_config, self.quantization, int8_key_scales=self.kv_format.storage == torch.int8)
        model.load_weights(weights)
        # .to(dtype) would also cast bf16 weight buffers, so only a float32-linear model changes dtype.
        model.to(device=self.device)
        self.model = (model if self.dtype == torch.float32 else model.to(dtype=self.dtype)).eval()
        self.num_kv_blocks = num_kv_blocks_for(config, model_config)
        # one block past the pool, never handed out: the padding rows of a captured decode batch write there
        self.scratch_block = self.num_kv_blocks
        self.kv_caches = [
            allocate_layer_kv(self.num_kv_blocks + 1, config.block_size, model_config.num_kv_heads,
                              model_config.head_dim, self.kv_format, self.device)
            for _ in range(model_config.num_layers)
        ]
        # multi-LoRA: the adapters' slots are attached before the caches, so the native stack adds them too
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            self.lora = LoRAManager(config, model_config, self.device, self.model.rotary_order,
                                    lora_dtype(config))
            self.model.attach_lora(self.lora.slots, self.lora.context)
        self.model.bind_kv_caches(self.kv_caches)
        self.kv_cache_bytes = kv_bytes_per_block(model_config, config.block_size, self.kv_format) * self.num_kv_blocks
        logger.info("KV cache %s: %s tokens in %d blocks of %d (%.0f MiB)", self.kv_format.name,
                    f"{self.num_kv_blocks * config.block_size:,}", self.num_kv_blocks, config.block_size,
                    self.kv_cache_bytes / 2**20)
        self.max_model_len = min(config.max_model_len or model_config.max_context_len, model_config.max_context_len)
        self.decode_graphs: DecodeGraphs | None = None
        reason = eager_reason(config, model_config)
        if reason is None:
            try:
                self.capture_decode_graphs(capture_sizes(config.max_num_seqs))
            except RuntimeError as error:  # a kernel that cannot be captured: serve eagerly rather than not at all
                logger.warning("CUDA graph capture failed, decode steps run eagerly: %s", error)
        elif self.device.type == "cuda":
            logger.info("decode steps run eagerly: %s", reason)
        self.sampler = Sampler()
        self._generators: dict[str, tuple[int, torch.Generator]] = {}  # request -> (base seed, generator)
        self._seed_source = random.Random(config.seed)  # seeds for requests that bring none

    @torch.inference_mode()
    def capture_decode_graphs(self, sizes: list[int], capture: Capture | None = None) -> None:
        """Capture the decoder layers for decode batches of these sizes (executor/cuda_graphs.py); `capture`:
        CUDA graphs unless given."""
        self.decode_graphs = DecodeGraphs(self.model, sizes, self.scratch_block, self.block_size,
                                          -(-self.max_model_len // self.block_size), self.max_model_len,
                                          self.device, self.model.norm.weight.dtype, capture or CudaGraphCapture())

    @property
    def long_rope_threshold(self) -> int | None:
        """longrope's original context: a sequence that grows past it has its KV recomputed with the long factors
        (the scheduler does it); None for other scalings."""
        config = self.model.config
        if config.rope_scaling.rope_type != "longrope":
            return None
        return config.rope_scaling.length_threshold(config.max_position_embeddings)

    def kv_identity(self) -> dict[str, object]:
        """What this runner's KV blocks depend on besides their tokens and salts (the disk tier's namespace,
        kv_offload/identity.py): the linear layers' mode, dtypes, block size and the kernels' instruction set."""
        isa = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")))
        return {"quantization": self.quantization, "dtype": str(self.dtype), "kv_cache_dtype": self.kv_format.name,
                "block_size": self.block_size, "device": self.device.type, "isa": isa}

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one block over all layers, as read_kv_blocks moves them."""
        return sum(cache.block_bytes for cache in self.kv_caches)

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The KV of these blocks, [blocks, layers, 2 (K, V), elements], for a KV connector to move. An 8-bit
        cache moves as it is stored: each of K and V as raw bytes, its values and then its scales."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        count = len(block_ids)

        def part(values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
            flat = values[index].reshape(count, -1)
            if scales is None:
                return flat
            return torch.cat([flat.view(torch.uint8), scales[index].reshape(count, -1).view(torch.uint8)], dim=1)

        return torch.stack([torch.stack([part(c.k, c.k_scale), part(c.v, c.v_scale)], dim=1)
                            for c in self.kv_caches], dim=1).cpu()

    def write_kv_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Store blocks read by `read_kv_blocks` (on another engine) into these blocks, between steps (the KV
        loader calls it from the engine's thread). Float KV converts to this cache's dtype; an 8-bit cache takes
        only the bytes of its own format."""
        block_bytes = self.kv_caches[0].block_bytes // 2
        if self.kv_format.scaled or data.dtype == torch.uint8:
            if data.dtype != torch.uint8 or data.shape[-1] != block_bytes:
                raise ValueError(f"KV blocks of {data.dtype} x {data.shape[-1]} do not fit this engine's "
                                 f"{self.kv_format.name} cache ({block_bytes} bytes of K per block and layer)")
        else:
            data = data.to(self.kv_caches[0].k.dtype)
        index = torch.tensor(block_ids, dtype=torch.long)
        for layer, cache in enumerate(self.kv_caches):
            for which, tensors in enumerate(((cache.k, cache.k_scale), (cache.v, cache.v_scale))):
                source = data[:, layer, which].contiguous().view(torch.uint8)
                start = 0
                for tensor in tensors:
                    if tensor is None:
                        continue
                    flat = tensor.view(tensor.shape[0], -1).view(torch.uint8)  # raw bytes: any dtype goes
                    flat[index.to(tensor.device)] = source[:, start:start + flat.shape[1]].to(tensor.device)
                    start += flat.shape[1]

    def _generator(self, request_id: str, seed: int | None, position: int) -> torch.Generator:
        """The request's generator, seeded for the output token at `position`: its draws depend on (seed,
        position) alone, so a request recomputed on another engine (engine/migration.py) continues the same
        sequence."""
        entry = self._generators.get(request_id)
        if entry is None:
            base = seed if seed is not None else self._seed_source.getrandbits(63)
            entry = (base, torch.Generator(device=self.device))
            self._generators[request_id] = entry
        base, generator = entry
        generator.manual_seed(position_seed(base, position))
        return generator

    def _forward(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, np.ndarray]:
        """Hidden states [T, hidden] of the flat batch, and each request's last row in it."""
        bs = self.block_size
        input_ids: list[int] = []
        for s in scheduled:
            input_ids.extend(s.token_ids)
        query_lens = np.fromiter((s.num_tokens for s in scheduled), np.int64, len(scheduled))
        starts = np.fromiter((s.start_position for s in scheduled), np.int64, len(scheduled))
        max_blocks = max(len(s.block_table) for s in scheduled)
        tables = np.zeros((len(scheduled), max_blocks), np.int64)
        for i, s in enumerate(scheduled):
            tables[i, :len(s.block_table)] = s.block_table
        # Per token: its sequence, its position, and the slot its K/V goes to; no per-token Python loop.
        seq_of_token = np.repeat(np.arange(len(scheduled)), query_lens)
        first_row = np.cumsum(query_lens) - query_lens
        positions = starts[seq_of_token] + np.arange(len(input_ids)) - first_row[seq_of_token]
        slots = tables[seq_of_token, positions // bs] * bs + positions % bs
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        graphs = self.decode_graphs
        if (graphs is not None and len(input_ids) == len(scheduled) and graphs.covers(len(scheduled))
                and max_blocks <= graphs.max_blocks):
            hidden = graphs.run(self.model.embed(ids), positions, slots, starts + query_lens, tables)
            return hidden, first_row + query_lens - 1
        meta = AttentionMetadata.build(query_lens, starts + query_lens, tables, slots, bs, self.device)
        if self.lora is not None:
            self.lora.prepare(scheduled)
        rope_lengths = None
        if self.model.config.rope_scaling.length_dependent:
            # each token rotated for the length transformers' generate would have had: the prompt's, then its own
            prompt_lens = np.fromiter((max(len(s.prompt_token_ids), s.rope_length) for s in scheduled), np.int64,
                                      len(scheduled))
            rope_lengths = torch.from_numpy(np.maximum(prompt_lens[seq_of_token], positions + 1)).to(self.device)
        hidden = self.model(
            ids,
            torch.from_numpy(positions).to(self.device),
            meta,
            rope_lengths,
        )
        return hidden, first_row + query_lens - 1

    @torch.inference_mode()
    def compute_logits(self, plan: SchedulerOutput) -> tuple[list[ScheduledRequest], torch.Tensor | None]:
        """Run the flat batch; logits of the requests that sample this step (in plan order): one row each, or
        1 + k rows for a request verifying k proposed tokens (its last 1 + k positions)."""
        sampled, logits, _, _ = self._run(plan)
        return sampled, logits

    def _run(self, plan: SchedulerOutput
             ) -> tuple[list[ScheduledRequest], torch.Tensor | None, PromptLogprobs, dict[str, list[float]]]:
        """compute_logits, the prompt logprobs of the chunks that asked for them, and the embeddings of the
        pooling requests whose prompt ends this step (the last token's hidden state; they sample nothing)."""
        hidden, last_rows = self._forward(plan.scheduled)
        prompt_logprobs = {s.request_id: self._score_prompt(s, hidden, int(last)) for s, last in
                           zip(plan.scheduled, last_rows) if s.score_prompt and not s.padding}
        pooled = {s.request_id: hidden[int(last_rows[i])].float().tolist() for i, s in enumerate(plan.scheduled)
                  if s.sample and not s.padding and s.sampling_params.pool}
        sampled = [(i, s) for i, s in enumerate(plan.scheduled)
                   if s.sample and not s.padding and not s.sampling_params.pool]
        if not sampled:
            return [], None, prompt_logprobs, pooled
        if any(s.num_spec_tokens for _, s in sampled):
            rows = np.concatenate([np.arange(last_rows[i] - s.num_spec_tokens, last_rows[i] + 1) for i, s in sampled])
        else:
            rows = last_rows[[i for i, _ in sampled]]
        logits = self.model.compute_logits(hidden[torch.from_numpy(rows).to(self.device)])
        return [s for _, s in sampled], logits, prompt_logprobs, pooled

    def _score_prompt(self, s: ScheduledRequest, hidden: torch.Tensor, last_row: int) -> tuple[int, PromptEntries]:
        """The logprobs of the prompt tokens this chunk predicts (its rows but the one after the prompt's last
        token): (the first one's position, an entry each). Log-softmax runs over a few rows at a time, and
        only each row's chosen token and top-N are kept, so no prompt's logits are held at vocabulary size."""
        prompt = s.prompt_token_ids
        first_row = last_row - s.num_tokens + 1
        count = max(0, min(s.num_tokens, len(prompt) - 1 - s.start_position))
        targets = prompt[s.start_position + 1:s.start_position + 1 + count]
        entries: PromptEntries = []
        for begin in range(0, count, SCORE_ROWS):
            end = min(count, begin + SCORE_ROWS)
            logprobs = self.model.compute_logits(hidden[first_row + begin:first_row + end]).float().log_softmax(-1)
            entries += logprob_entries(logprobs, targets[begin:end], s.sampling_params.prompt_logprobs or 0)
        return s.start_position + 1, entries

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int], lora_request: LoRARequest | None = None) -> torch.Tensor:
        """Logits [len, vocab] after every token of one sequence run as a single prompt (teacher forcing).

        For quality measurements (perplexity, agreement between modes): it writes KV blocks 0..n, so call it
        only on a runner that serves nothing else.
        """
        table = list(range(-(-len(token_ids) // self.block_size)))
        if len(table) > self.num_kv_blocks:
            raise ValueError(f"{len(token_ids)} tokens need {len(table)} KV blocks; the cache has {self.num_kv_blocks}")
        request = ScheduledRequest("score", list(token_ids), 0, table, False, SamplingParams(), list(token_ids), [],
                                   lora_request=lora_request)
        hidden, _ = self._forward([request])
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in plan.finished_request_ids:
            self._generators.pop(request_id, None)
        if plan.is_empty:
            return ModelRunnerOutput({})
        sampled, logits, prompt_logprobs, pooled = self._run(plan)
        if logits is None:
            return ModelRunnerOutput({}, prompt_logprobs=prompt_logprobs, pooled=pooled)
        if plan.grammar_bitmask is not None:
            # as in vLLM, before the sampler: logprobs are those of the constrained distribution
            apply_bitmask(logits, self._structured_rows(sampled), plan.grammar_bitmask)
        if any(s.num_spec_tokens for s in sampled):
            verified = self._verify(sampled, logits)
            verified.prompt_logprobs = prompt_logprobs
            verified.pooled = pooled
            return verified
        rows = [SamplingRow(s.sampling_params, s.prompt_token_ids, s.output_token_ids, self._row_generator(s),
                            s.banned_token_ids) for s in sampled]
        result = self.sampler(logits, rows)
        return ModelRunnerOutput(
            sampled_token_ids={s.request_id: t for s, t in zip(sampled, result.token_ids)},
            logprobs={s.request_id: lp for s, lp in zip(sampled, result.logprobs) if lp is not None},
            prompt_logprobs=prompt_logprobs,
            pooled=pooled,
        )

    @staticmethod
    def _structured_rows(sampled: list[ScheduledRequest]) -> torch.Tensor:
        """Logits rows (1 + num_spec_tokens per sampled request) of the structured requests, in plan order."""
        rows: list[int] = []
        first = 0
        for s in sampled:
            if s.structured:
                rows.extend(range(first, first + 1 + s.num_spec_tokens))
            first += 1 + s.num_spec_tokens
        return torch.tensor(rows, dtype=torch.long)

    def _generator_at(self, s: ScheduledRequest, row: int) -> torch.Generator:
        """The request's generator for the `row`-th position this step samples (its output position + row)."""
        return self._generator(s.request_id, s.sampling_params.seed, len(s.output_token_ids) + row)

    def _row_generator(self, s: ScheduledRequest) -> torch.Generator | None:
        return None if s.sampling_params.greedy else self._generator_at(s, 0)

    def _verify(self, sampled: list[ScheduledRequest], logits: torch.Tensor) -> ModelRunnerOutput:
        """A step with proposed tokens: each request's 1 + k rows are processed as the k + 1 positions they are
        (penalties see the proposals before them, min_tokens counts them), then verified."""
        rows: list[SamplingRow] = []
        for s in sampled:
            proposed = s.token_ids[len(s.token_ids) - s.num_spec_tokens:]
            generator = self._row_generator(s)
            for j in range(s.num_spec_tokens + 1):
                outputs = list(s.output_token_ids) + proposed[:j] if j else s.output_token_ids
                banned = s.banned_token_ids if len(s.output_token_ids) + j < s.sampling_params.min_tokens else ()
                rows.append(SamplingRow(s.sampling_params, s.prompt_token_ids, outputs, generator, banned))
        processed = self.sampler.process(logits, rows)
        raw_logprobs = None
        if any(s.sampling_params.logprobs is not None for s in sampled):
            raw_logprobs = logits.float().log_softmax(dim=-1)
        out = ModelRunnerOutput({})
        first = 0
        for s in sampled:
            k = s.num_spec_tokens
            block = processed[first:first + k + 1]
            proposed = s.token_ids[len(s.token_ids) - k:] if k else []
            if s.sampling_params.greedy:
                emitted = verify_greedy(block, proposed)
            else:
                emitted = verify_random(random_probs(block, [s.sampling_params] * (k + 1)), proposed,
                                        functools.partial(self._generator_at, s))
            top_n = s.sampling_params.logprobs
            entries = [] if raw_logprobs is None or top_n is None else [
                logprob_entry(raw_logprobs[first + j], token, top_n) for j, token in enumerate(emitted)]
            out.sampled_token_ids[s.request_id] = emitted[-1]
            if len(emitted) > 1:
                out.accepted_token_ids[s.request_id] = emitted[:-1]
            if entries:
                out.logprobs[s.request_id] = entries[-1]
                out.accepted_logprobs[s.request_id] = entries[:-1]
            first += k + 1
        return out


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The seed of a request's draw for output token `position`: splitmix64 of (seed, position), so that the
    streams of neighbouring positions (and seeds) are unrelated."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # 63 bits: every torch generator takes it
