"""CUDA graphs for decode steps (vLLM's shape): the decoder layers of a decode-only batch are captured once per
batch size at start-up and replayed, so a step launches one graph instead of hundreds of small kernels.

A graph reads and writes fixed addresses, so a step's inputs are copied into static buffers (hidden states
after the embedding, positions, KV slots, context lengths, block tables) and the batch is padded up to the next
captured size. The padding rows write their K/V into a scratch block that the runner allocates past the pool
(the scheduler never hands it out) and attend only to it; their outputs are dropped. The embedding, the LM head
and the sampler run outside the graph.

Only plain decode steps replay a graph: prompt chunks, proposals to verify (several rows per sequence), LoRA
adapters (rows change adapters every step) and length-dependent rope (it branches on the lengths on the host)
run eagerly, as does everything with `--enforce-eager`. The capture itself is a parameter, so the static-buffer
plumbing runs on CPU in the tests, replayed eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.kernels import triton_ops
from tokenmill.model.attention import AttentionMetadata, to_device
from tokenmill.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

Step = Callable[[], torch.Tensor]  # one decode step over the static buffers; returns its hidden states
Capture = Callable[[Step], Step]  # a step -> a replay of it

MAX_CAPTURED_BATCH = 512  # vLLM's default largest captured size


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to max_num_seqs (vLLM's ladder): a batch pads to the next one."""
    largest = min(max_num_seqs, MAX_CAPTURED_BATCH)
    ladder = [1, 2, 4, 8, *range(16, largest + 1, 16)]
    return sorted({size for size in ladder if size <= largest} | {largest})


def eager_reason(config: EngineConfig, model_config: ModelConfig) -> str | None:
    """Why decode steps run eagerly on this engine; None where they are captured as CUDA graphs."""
    device = torch.device(config.device)
    if device.type != "cuda":
        return "not a CUDA device"
    if config.enforce_eager:
        return "--enforce-eager"
    if not triton_ops.attention_kernel_serves(device, model_config.head_dim, config.block_size):
        # the torch reference attention builds its tensors from host arrays each step: nothing to capture
        return "no Triton attention kernel for this device and shape"
    if config.kv_cache_dtype.startswith("fp8") and torch.cuda.get_device_capability(device) < (8, 9):
        return "an fp8 KV cache below compute capability 8.9 (the torch attention reads it)"
    if config.enable_lora:
        return "LoRA adapters"
    if model_config.rope_scaling.length_dependent:
        return "length-dependent rope scaling"
    return None


class CudaGraphCapture:
    """Captures on the current CUDA device, every graph in one memory pool: the graphs never run at the same
    time, so the smaller ones reuse what the largest one's intermediates took."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, step: Step) -> Step:
        # warm-up on a side stream first (Triton compiles, the rope tables grow, the allocator settles)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


def replay_eagerly(step: Step) -> Step:
    """A capture that runs the step again on every replay (CPU tests of the static buffers and padding)."""
    return step


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, sizes: list[int], scratch_block: int, block_size: int,
                 max_blocks: int, max_positions: int, device: torch.device, dtype: torch.dtype,
                 capture: Capture) -> None:
        self.sizes = sorted(sizes)
        self.scratch_block, self.block_size, self.max_blocks = scratch_block, block_size, max_blocks
        largest = self.sizes[-1]
        self.hidden = torch.zeros(largest, model.config.hidden_size, dtype=dtype, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slots = torch.full((largest,), scratch_block * block_size, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.long, device=device)
        self.query_start = torch.arange(largest + 1, dtype=torch.long, device=device)
        self.tables = torch.full((largest, max_blocks), scratch_block, dtype=torch.long, device=device)
        self.replays: dict[int, Step] = {}
        self.replayed = 0  # steps served by a graph
        started = time.perf_counter()
        # largest first, as vLLM does: the smaller graphs reuse the memory the largest one reserved
        for done, size in enumerate(reversed(self.sizes), 1):
            self.replays[size] = capture(self._step(model, size, max_positions))
            if done % 8 == 0 or done == len(self.sizes):
                logger.info("capturing CUDA graphs for decode batches: %d/%d sizes (%.1f s)", done, len(self.sizes),
                            time.perf_counter() - started)

    def _step(self, model: LlamaForCausalLM, size: int, max_positions: int) -> Step:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size], query_start=self.query_start[:size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.tables[:size], block_size=self.block_size,
            # host copies: the model reads only the longest length, to grow its rope tables once, to the context
            query_lens_np=np.ones(size, np.int64), seq_lens_np=np.full(size, max_positions, np.int64),
            block_tables_np=np.zeros((size, self.max_blocks), np.int64))

        def step() -> torch.Tensor:
            return model.run_layers(self.hidden[:size], self.positions[:size], meta)

        return step

    def covers(self, num_rows: int) -> bool:
        return num_rows <= self.sizes[-1]

    def run(self, hidden: torch.Tensor, positions: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray,
            tables: np.ndarray) -> torch.Tensor:
        """The decoder layers' output [n, hidden] for n decode rows (embedded `hidden`), by a graph's replay."""
        n = hidden.shape[0]
        size = next(s for s in self.sizes if s >= n)
        device = self.hidden.device
        self.hidden[:n].copy_(hidden)
        self.positions[:n].copy_(to_device(positions, device))
        self.slots[:n].copy_(to_device(slots, device))
        self.seq_lens[:n].copy_(to_device(seq_lens, device))
        width = tables.shape[1]
        self.tables[:n, :width].copy_(to_device(np.ascontiguousarray(tables), device))
        self.tables[:n, width:].fill_(self.scratch_block)
        # the padding rows (left over from a larger batch): one token at the scratch block's first slot
        self.positions[n:size].zero_()
        self.slots[n:size].fill_(self.scratch_block * self.block_size)
        self.seq_lens[n:size].fill_(1)
        self.tables[n:size].fill_(self.scratch_block)
        self.replayed += 1
        return self.replays[size]()[:n]
