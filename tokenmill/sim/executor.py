"""An executor that runs no model: it advances a simulated clock by each plan's predicted step time."""

from __future__ import annotations

from tokenmill.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenmill.sim.cost_model import StepShape, step_seconds
from tokenmill.sim.specs import HardwareProfile, ModelSpec

# The token every simulated step emits; requests end by max_tokens (no EOS in the simulation).
SIMULATED_TOKEN = 1


class SimClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def kv_blocks_for(model: ModelSpec, hw: HardwareProfile, block_size: int, tensor_parallel: int = 1,
                  memory_utilization: float = 0.9, kv_cache_memory_gb: float = 1.0) -> int:
    """KV blocks that fit in the device memory left after the weights (vLLM's gpu_memory_utilization); on a
    CPU profile (no device memory) the pool is `kv_cache_memory_gb`, as the CPU engine sizes it."""
    per_block = model.kv_bytes_per_token(hw.kv_bytes) * block_size
    if hw.memory_bytes <= 0:
        return max(1, int(kv_cache_memory_gb * 2**30 // per_block))
    free = hw.memory_bytes * tensor_parallel * memory_utilization - model.num_params * hw.weight_bytes
    if free < per_block:
        raise ValueError(f"{model.name} ({model.num_params / 1e9:.1f}B parameters) does not fit on "
                         f"{tensor_parallel} x {hw.name}")
    return int(free // per_block)


class SimExecutor:
    def __init__(self, model: ModelSpec, hw: HardwareProfile, clock: SimClock, num_kv_blocks: int,
                 tensor_parallel: int = 1) -> None:
        self.model = model
        self.hw = hw
        self.clock = clock
        self.num_kv_blocks = num_kv_blocks
        self.tensor_parallel = tensor_parallel
        self.busy_seconds = 0.0
        self.num_steps = 0

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        seconds = step_seconds(StepShape.of(plan), self.model, self.hw, self.tensor_parallel)
        self.clock.now += seconds
        self.busy_seconds += seconds
        self.num_steps += bool(plan.scheduled)
        return ModelRunnerOutput({s.request_id: SIMULATED_TOKEN for s in plan.scheduled
                                  if s.sample and not s.padding})
