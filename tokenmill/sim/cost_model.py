"""Predicted time of one model step from its plan: FLOPs and bytes of the linear layers, the LM head and the
attention of every sequence, against a hardware profile (a roofline with efficiency factors and overheads)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.core.outputs import SchedulerOutput
from tokenmill.sim.specs import HardwareProfile, ModelSpec


@dataclass(frozen=True)
class StepShape:
    """What a step computes, per sequence: (new tokens, tokens before them, rows sampled)."""

    sequences: tuple[tuple[int, int, int], ...]

    @classmethod
    def of(cls, plan: SchedulerOutput) -> StepShape:
        return cls(tuple((s.num_tokens, s.start_position,
                          (1 + s.num_spec_tokens) if s.sample and not s.padding else 0) for s in plan.scheduled))

    @property
    def num_tokens(self) -> int:
        return sum(q for q, _, _ in self.sequences)


@dataclass(frozen=True)
class StepCost:
    flops: float
    bytes: float  # weights, KV written, activations
    kv_read_bytes: float  # the KV cache the attention reads (its own efficiency: kernels differ most there)


def step_cost(shape: StepShape, model: ModelSpec, weight_bytes: float, kv_bytes: float,
              tensor_parallel: int = 1) -> StepCost:
    """FLOPs and memory traffic of one step, per device of a tensor-parallel group."""
    tokens = shape.num_tokens
    sampled = sum(rows for _, _, rows in shape.sequences)
    flops = 2.0 * model.layer_params * tokens + 2.0 * model.head_params * sampled
    attention = 0.0
    kv_read = 0.0
    for new, before, _ in shape.sequences:
        # QK^T and PV over the context each new token sees (causal inside the chunk)
        attention += 4.0 * model.num_layers * model.num_heads * model.head_dim * new * (before + (new + 1) / 2)
        kv_read += model.kv_bytes_per_token(kv_bytes) * (before + new)
    weights = (model.layer_params + (model.head_params if sampled else 0)) * weight_bytes
    kv_write = model.kv_bytes_per_token(kv_bytes) * tokens
    activations = 4.0 * tokens * model.hidden_size * model.num_layers * 2  # residual stream in and out, float32
    return StepCost((flops + attention) / tensor_parallel, (weights + kv_write + activations) / tensor_parallel,
                    kv_read / tensor_parallel)


def chunks_seconds(chunks: list[tuple[int, int]], model: ModelSpec, hw: HardwareProfile,
                   tensor_parallel: int = 1) -> float:
    """A step of (new tokens, tokens before) per sequence, each sampling one row: what `--target-itl-ms`'s
    predictor is warm-started with."""
    return step_seconds(StepShape(tuple((new, before, 1) for new, before in chunks)), model, hw, tensor_parallel)


def step_seconds(shape: StepShape, model: ModelSpec, hw: HardwareProfile, tensor_parallel: int = 1) -> float:
    if not shape.sequences:
        return 0.0
    cost = step_cost(shape, model, hw.weight_bytes, hw.kv_bytes, tensor_parallel)
    compute = cost.flops / (hw.peak_flops * hw.flops_efficiency)
    kv_efficiency = hw.kv_read_efficiency or hw.bandwidth_efficiency
    memory = (cost.bytes / hw.bandwidth_efficiency + cost.kv_read_bytes / kv_efficiency) / hw.memory_bandwidth
    work = max(compute, memory) if hw.combine == "max" else compute + memory
    return hw.step_overhead_s + hw.per_sequence_s * len(shape.sequences) + work
