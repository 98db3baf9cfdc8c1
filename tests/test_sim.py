"""The simulator: the cost model's monotonicity, KV sizing from memory, and the simulated clock driving the real
scheduler deterministically (with the expected continuous-vs-static shape)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from tokenmill.bench.loadgen import arrival_times
from tokenmill.bench.workloads import WorkItem
from tokenmill.config import EngineConfig
from tokenmill.executor.model_runner import ModelRunner
from tokenmill.sampling_params import SamplingParams
from tokenmill.sim import specs
from tokenmill.sim.calibrate import trace
from tokenmill.sim.cost_model import StepShape, step_seconds
from tokenmill.sim.data_parallel import DataParallelSimulation
from tokenmill.sim.executor import kv_blocks_for
from tokenmill.sim.questions import capacity, goodput_knee, steady_workload, sweep
from tokenmill.sim.simulator import Simulation
from tokenmill.sim.trace import StepTraceWriter, read_step_trace

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


def test_rate_sweep_finds_the_goodput_knee_and_capacity_splits_the_rate() -> None:
    config = EngineConfig(max_num_seqs=128, max_num_batched_tokens=4096)
    simulation = Simulation(LLAMA8B, H100, config)
    steady = steady_workload(workload, num_requests=50, duration=4.0)
    assert len(steady(1.0)) == 50 and len(steady(20.0)) == 80 and len(steady(float("inf"))) == 50
    points = sweep(simulation, steady, "request-rate", [5, 40, 200], rate=0.0, slo_ttft=0.5)
    shares = [p.summary["good_share"] for p in points]
    assert shares[0] == 1.0 and shares[-1] < 0.5, shares  # far past the knee, queues blow the TTFT SLO
    knee = goodput_knee(points)
    assert knee is not None and knee.value in (5.0, 40.0)
    assert knee.summary["good_share"] >= 0.9
    # an engine setting varies while the arrivals stay: fewer sequences per step cannot be faster
    seqs = sweep(simulation, steady, "max-num-seqs", ["4", "128"], rate=40.0)
    assert [p.value for p in seqs] == [4, 128]
    assert seqs[0].summary["e2e_s"]["p50"] > seqs[1].summary["e2e_s"]["p50"]
    with pytest.raises(ValueError, match="cannot sweep"):
        sweep(simulation, steady, "block-size", [16], rate=1.0)

    answer = capacity(simulation, steady, 200.0, slo_ttft=0.5, slo_tpot=None)
    assert answer.replicas is not None and answer.replicas > 1
    tried = dict(answer.tried)
    assert tried[answer.replicas] >= 0.9  # enough replicas meet the SLO ...
    assert answer.replicas - 1 not in tried or tried[answer.replicas - 1] < 0.9  # ... and one fewer does not
    assert answer.per_replica_rate == pytest.approx(200.0 / answer.replicas)
    with pytest.raises(ValueError, match="needs an SLO"):
        capacity(simulation, steady, 1.0, None, None)


def test_calibration_trace_times_every_model_step_of_a_real_run(loaded_model, tokenizer) -> None:  # noqa: ANN001
    """The wall-clock trace lines each model call up with its engine step, and every token is accounted for."""
    config = EngineConfig(quantization="none", max_num_batched_tokens=64)
    runner = ModelRunner(dataclasses.replace(config, num_kv_blocks=64), loaded_model.config, loaded_model.weights)
    items = [WorkItem("", tokenizer.encode(text), n) for text, n in (("The sky is", 3), ("One two three " * 12, 2))]
    steps = trace(runner, 64, config, items, rate=float("inf"))
    assert sum(s.shape.num_tokens for s in steps) == sum(len(i.prompt_token_ids) + i.max_tokens - 1 for i in items)
    assert max(s.shape.num_tokens for s in steps) <= 64  # the token budget chunked the longer prompt
    assert all(0 < s.model_seconds <= s.step_seconds for s in steps)


def test_step_trace_records_each_model_step_for_calibration(llm, tmp_path) -> None:  # noqa: ANN001
    """What `tokenmill serve --step-trace` writes reads back as the steps the engine ran."""
    engine = llm.engine
    writer = StepTraceWriter(tmp_path / "trace.jsonl")
    prompt = llm.tokenizer.encode("Write one sentence about rivers and valleys, please.")
    engine.add_request("traced", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=5, ignore_eos=True,
                                                                              temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
        assert engine.core.last_step is not None
        writer.on_step(engine.core.last_step)
    writer.close()
    steps = read_step_trace(tmp_path / "trace.jsonl")
    assert sum(shape.num_tokens for shape, _ in steps) == len(prompt) + 4  # the last token is never fed back
    assert steps[0][0].sequences[0][1] == 0 and all(seconds > 0 for _, seconds in steps)
    assert [shape.sequences[0][1] for shape, _ in steps[-4:]] == list(range(len(prompt), len(prompt) + 4))
    assert read_step_trace(tmp_path / "trace.jsonl", skip=2) == steps[2:]


def test_data_parallel_simulation_prefix_aware_routing_keeps_the_cache_hits() -> None:
    """Two replicas whose KV pools hold half of 8 long system prompts each: prefix-aware routing keeps each
    prompt on one replica; round-robin makes both replicas cycle all 8 through their pools."""
    rng = random.Random(0)
    prefixes = [[1000 * (p + 1) + j for j in range(512)] for p in range(8)]
    items = [WorkItem("", prefixes[rng.randrange(8)] + [rng.randrange(3, 900) for _ in range(20)], 8)
             for _ in range(300)]
    arrivals = arrival_times(items, 30.0, seed=0)
    config = EngineConfig(num_kv_blocks=160, max_num_seqs=32, max_num_batched_tokens=2048)
    replica = Simulation(LLAMA8B, specs.hardware("a100-80gb"), config)
    runs = {router: DataParallelSimulation(replica, 2, router).run(items, arrivals)
            for router in ("round-robin", "prefix-aware")}
    for run in runs.values():
        assert run.summary["completed"] == 300 and sum(run.requests_per_replica) == 300
    aware, blind = runs["prefix-aware"], runs["round-robin"]
    assert aware.prefix_hit_rate > blind.prefix_hit_rate + 0.2, (aware.prefix_hit_rate, blind.prefix_hit_rate)
    assert aware.summary["ttft_s"]["p50"] < blind.summary["ttft_s"]["p50"]
    assert aware.decisions["prefix"] > 250 and min(aware.requests_per_replica) > 60  # affinity, yet both used
    again = DataParallelSimulation(replica, 2, "prefix-aware").run(items, arrivals)
    assert again.summary == aware.summary  # deterministic
