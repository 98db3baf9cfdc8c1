"""The simulator: the cost model's monotonicity, KV sizing from memory, and the simulated clock driving the real
scheduler deterministically (with the expected continuous-vs-static shape)."""

from __future__ import annotations

import dataclasses

import pytest

from tokenmill.bench.loadgen import arrival_times
from tokenmill.bench.workloads import WorkItem
from tokenmill.config import EngineConfig
from tokenmill.sim import specs
from tokenmill.sim.cost_model import StepShape, step_seconds
from tokenmill.sim.executor import kv_blocks_for
from tokenmill.sim.simulator import Simulation

LLAMA8B, H100 = specs.model("llama-3-8b"), specs.hardware("h100-sxm")


def decode(batch: int, context: int) -> StepShape:
    return StepShape(tuple((1, context, 1) for _ in range(batch)))


def test_cost_model_is_monotone() -> None:
    t = lambda shape, model=LLAMA8B, hw=H100, tp=1: step_seconds(shape, model, hw, tp)  # noqa: E731
    # more sequences, longer contexts, longer prompt chunks: never faster
    for batch in (1, 8, 64, 256):
        assert t(decode(batch, 512)) <= t(decode(2 * batch, 512))
        assert t(decode(batch, 512)) <= t(decode(batch, 4096))
    for chunk in (16, 256, 2048):
        assert t(StepShape(((chunk, 0, 1),))) < t(StepShape(((2 * chunk, 0, 1),)))
        assert t(StepShape(((chunk, 1024, 1),))) > t(StepShape(((chunk, 0, 1),)))
    # small decode batches are memory-bound: 8x the batch costs far less than 8x the time
    assert t(decode(64, 512)) < 2 * t(decode(8, 512))
    # a long prefill is compute-bound: twice the tokens, about twice the time
    assert 1.7 < t(StepShape(((8192, 0, 1),))) / t(StepShape(((4096, 0, 1),))) < 2.3
    # faster memory, tensor parallelism and a smaller model all help
    assert t(decode(8, 512), hw=specs.hardware("h200")) < t(decode(8, 512))
    assert t(decode(8, 512), tp=2) < t(decode(8, 512))
    assert t(decode(8, 512), model=specs.model("smollm2-135m")) < t(decode(8, 512))
    assert t(StepShape(())) == 0.0


def test_kv_pool_is_the_memory_left_after_the_weights() -> None:
    seventy = specs.model("llama-3-70b")
    with pytest.raises(ValueError, match="does not fit"):
        kv_blocks_for(seventy, H100, 16)
    assert kv_blocks_for(seventy, H100, 16, tensor_parallel=4) > 0
    blocks = kv_blocks_for(LLAMA8B, H100, 16)
    free = 0.9 * 80e9 - LLAMA8B.num_params * 2
    assert blocks == int(free // (LLAMA8B.kv_bytes_per_token(2) * 16))
    assert abs(LLAMA8B.num_params / 8.03e9 - 1) < 0.01  # the shapes add up to the published size


def workload(n: int, seed: int = 0) -> list[WorkItem]:
    return [WorkItem("", [(7 * i + j) % 30000 + 3 for j in range(64 + (i * 37) % 400)], 16 + (i * 53) % 300)
            for i in range(n)]


def test_simulation_is_deterministic_and_runs_the_real_scheduler() -> None:
    items = workload(300)
    arrivals = arrival_times(items, 20.0, seed=1)
    config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048)
    first = Simulation(LLAMA8B, H100, config).run(items, arrivals)
    second = Simulation(LLAMA8B, H100, config).run(items, arrivals)
    assert first.summary == second.summary and first.step_seconds == second.step_seconds
    assert first.summary["completed"] == 300 and first.summary["failed"] == 0
    assert first.summary["output_tokens"] == sum(i.max_tokens for i in items)
    # the clock only moves by predicted step times (and idles until arrivals)
    assert first.busy_seconds == pytest.approx(sum(first.step_seconds))
    # a smaller KV pool preempts, and the same requests still all complete
    tight = Simulation(LLAMA8B, H100, dataclasses.replace(config, num_kv_blocks=200)).run(items, arrivals)
    assert tight.num_preemptions > 0 and tight.summary["completed"] == 300


def test_continuous_batching_beats_static_on_the_same_workload() -> None:
    items = workload(400)
    arrivals = arrival_times(items, float("inf"), seed=0)
    runs = {mode: Simulation(specs.model("opt-13b"), specs.hardware("a100-80gb"),
                             EngineConfig(batching=mode, max_num_seqs=32, max_num_batched_tokens=4096)).run(
                                 items, arrivals)
            for mode in ("continuous", "static")}
    ratio = runs["continuous"].summary["output_throughput"] / runs["static"].summary["output_throughput"]
    assert ratio > 1.3, ratio
    assert runs["continuous"].summary["e2e_s"]["p50"] < runs["static"].summary["e2e_s"]["p50"]
