"""`tokenmill sim calibrate`: time the local model runner over a grid of plans and take whole engine steps from a
server's step trace (or an in-process run), fit the cost model's factors to both, check the fit on held-out
plans and steps, and save a hardware profile (JSON)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenmill.bench import workloads
from tokenmill.bench.loadgen import arrival_times
from tokenmill.bench.machine import gemm_gflops, memory_bandwidth_gbs
from tokenmill.bench.workloads import WorkItem
from tokenmill.config import EngineConfig
from tokenmill.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from tokenmill.engine.core import EngineCore
from tokenmill.executor.model_runner import ModelRunner, num_kv_blocks_for
from tokenmill.model.loader import load_model
from tokenmill.model.tokenizer import Tokenizer
from tokenmill.sampling_params import SamplingParams
from tokenmill.sim import specs
from tokenmill.sim.cost_model import StepShape, step_cost, step_seconds
from tokenmill.sim.simulator import drive
from tokenmill.sim.trace import read_step_trace

# Plans: decode batches at several contexts, prompt chunks at several offsets, and the two mixed.
DECODES = [(batch, context) for batch in (1, 2, 4, 8, 16, 32, 64) for context in (32, 256, 1024)]
PREFILLS = [(chunk, offset) for chunk in (16, 64, 128, 256, 512) for offset in (0, 512)]
MIXED = [(batch, chunk) for batch in (4, 16, 48) for chunk in (64, 256, 448)]


def plan_shapes() -> list[StepShape]:
    shapes = [StepShape(tuple((1, context, 1) for _ in range(batch))) for batch, context in DECODES]
    shapes += [StepShape(((chunk, offset, 1),)) for chunk, offset in PREFILLS]
    shapes += [StepShape(tuple([(1, 300, 1)] * batch + [(chunk, 0, 0)])) for batch, chunk in MIXED]
    return shapes


def synthetic_plan(shape: StepShape, block_size: int) -> SchedulerOutput:
    """A plan with this shape over distinct KV blocks (their contents do not change the time)."""
    scheduled, next_block = [], 0
    for i, (new, before, rows) in enumerate(shape.sequences):
        blocks = math.ceil((before + new) / block_size)
        scheduled.append(ScheduledRequest(f"calibrate-{i}", [100] * new, before,
                                          list(range(next_block, next_block + blocks)), rows > 0,
                                          SamplingParams(temperature=0), [100], []))
        next_block += blocks
    return SchedulerOutput(scheduled)


def blocks_needed(shapes: list[StepShape], block_size: int) -> int:
    return max(sum(math.ceil((b + n) / block_size) for n, b, _ in s.sequences) for s in shapes)


class TimedExecutor:
    """The real model runner, recording each step's shape and how long the model took."""

    def __init__(self, runner: ModelRunner, num_kv_blocks: int) -> None:
        self.runner = runner
        self.num_kv_blocks = num_kv_blocks
        self.steps: list[tuple[StepShape, float]] = []

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        output = self.runner.execute(plan)
        self.steps.append((StepShape.of(plan), time.perf_counter() - start))
        return output


@dataclass
class TracedStep:
    shape: StepShape
    model_seconds: float  # the runner's execute
    step_seconds: float  # the whole engine step: schedule, execute, update


def trace(runner: ModelRunner, num_kv_blocks: int, config: EngineConfig, items: list[WorkItem], rate: float,
          seed: int = 0) -> list[TracedStep]:
    """The workload through the real engine core and runner on the wall clock, arrivals as `bench serve` sends
    them (the core sees a pool of `num_kv_blocks`): every step's shape and times."""
    executor = TimedExecutor(runner, num_kv_blocks)
    core = EngineCore(config, executor, max_model_len=8192, clock=time.monotonic)
    start = time.monotonic()
    arrivals = [start + t for t in arrival_times(items, rate, seed)]
    run = drive(core, items, arrivals, time.monotonic, lambda t: time.sleep(max(0.0, t - time.monotonic())))
    # the core calls the executor once per step, empty plans included: the two lists line up
    return [TracedStep(shape, model_seconds, step_seconds)
            for (shape, model_seconds), step_seconds in zip(executor.steps, run.step_seconds, strict=True)
            if shape.sequences]


@dataclass
class Calibration:
    profile: specs.HardwareProfile
    model: specs.ModelSpec  # the shapes the profile was fitted on
    grid_error: float  # median |predicted - measured| / measured model time, held-out grid plans
    trace_error: float  # the same for whole engine steps, held-out steps of the traced workload or server
    fit_error: float  # the same over everything fitted
    rows: list[tuple[str, float, float]]  # (plan, measured s, predicted s) of the held-out grid plans
    num_grid: int
    num_trace: int  # whole engine steps fitted and checked
    trace_source: str  # "server" (a step trace) or "in-process"


def describe(shape: StepShape) -> str:
    new = [n for n, _, _ in shape.sequences]
    decodes = sum(1 for n in new if n == 1)
    chunks = [n for n in new if n > 1]
    context = max(b for _, b, _ in shape.sequences)
    return f"{decodes} decodes + chunks {chunks}, context up to {context}"


def nonnegative_lstsq(features: np.ndarray, target: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted least squares with every coefficient >= 0 (a negative one is dropped and the rest refitted)."""
    active = list(range(features.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(features[:, active] * weights[:, None], target * weights, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        del active[int(np.argmin(coef))]
    full = np.zeros(features.shape[1])
    full[active] = np.maximum(coef, 0)
    return full


def time_grid(runner: ModelRunner, shapes: list[StepShape], block_size: int, repeats: int) -> list[float]:
    measured = []
    for shape in shapes:
        plan = synthetic_plan(shape, block_size)
        runner.execute(plan)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            runner.execute(plan)
            times.append(time.perf_counter() - start)
        measured.append(statistics.median(times))
    return measured


def calibrate(quantization: str = "auto", repeats: int = 5, seed: int = 0, trace_requests: int = 60,
              trace_rate: float = 2.0, step_trace: list[tuple[StepShape, float]] | None = None,
              model_path: str | None = None) -> Calibration:
    """Fit the profile to the model's time on a grid of synthetic plans (the extremes) and to whole engine steps
    as a server takes them: a server's `step_trace` when given (`tokenmill serve --step-trace`), else the steps
    of `mixed` at `trace_rate` through the engine core in this process. A quarter of each is held out.
    `model_path`: the model to time (default the bundled one)."""
    loaded = load_model(model_path)
    model = specs.spec_of(loaded.config, Path(loaded.path).name if model_path else "smollm2-135m")
    grid = plan_shapes()
    config = EngineConfig(quantization=quantization)
    serving_blocks = num_kv_blocks_for(config, loaded.config)  # the pool a server gets
    runner = ModelRunner(dataclasses.replace(config, num_kv_blocks=max(serving_blocks, blocks_needed(
        grid, config.block_size))), loaded.config, loaded.weights)
    grid_seconds = time_grid(runner, grid, config.block_size, repeats)
    if step_trace is None:
        tokenizer = Tokenizer.from_path(loaded.path, loaded.gguf_reader)
        items = workloads.mixed(tokenizer, trace_requests, seed=seed + 1)
        step_trace = [(t.shape, t.step_seconds) for t in trace(runner, serving_blocks, config, items, trace_rate,
                                                                  seed + 1)]
        source = "in-process"
    else:
        source = "server"

    weight_bytes = {"int8": 1.0, "bf16": 2.0}.get(runner.quantization, 4.0)
    kv_bytes = runner.kv_format.bytes_per_token_head(runner.model.config.head_dim) / runner.model.config.head_dim
    peak = gemm_gflops(runner.quantization) * 1e9
    bandwidth = memory_bandwidth_gbs() * 1e9
    shapes = grid + [shape for shape, _ in step_trace]
    measured = np.array(grid_seconds + [seconds for _, seconds in step_trace])
    # per step, per sequence (the engine's own time: scheduling, bookkeeping, handing outputs over), then the
    # model's arithmetic, its weights and activations, and the attention's KV reads
    features = np.array([[1.0, len(s.sequences), c.flops / peak, c.bytes / bandwidth, c.kv_read_bytes / bandwidth]
                         for s in shapes for c in [step_cost(s, model, weight_bytes, kv_bytes)]])
    rng = np.random.default_rng(seed)
    held_grid = set(rng.choice(len(grid), size=len(grid) // 4, replace=False).tolist())
    held_steps = {len(grid) + i for i in rng.choice(len(step_trace), size=len(step_trace) // 4,
                                                    replace=False).tolist()}
    fit = [i for i in range(len(shapes)) if i not in held_grid | held_steps]
    # Relative errors, but a step weighs more the longer it is (by the square root): the many short decode steps
    # must not drown the few long prefill steps that make the TTFT. The grid covers the extremes a workload
    # rarely reaches and weighs more than its share.
    weights = 1.0 / np.sqrt(measured)
    weights[:len(grid)] *= max(1.0, math.sqrt(len(step_trace) / len(grid)))
    coef = nonnegative_lstsq(features[fit], measured[fit], weights[fit])
    efficiency = [1.0 / c if c > 0 else 1e9 for c in coef[2:]]  # a term the fit dropped costs nothing
    profile = specs.HardwareProfile(
        name=f"cpu-{runner.quantization}", peak_flops=peak, memory_bandwidth=bandwidth, memory_bytes=0.0,
        flops_efficiency=efficiency[0], bandwidth_efficiency=efficiency[1], kv_read_efficiency=efficiency[2],
        step_overhead_s=float(coef[0]), per_sequence_s=float(coef[1]), weight_bytes=weight_bytes, kv_bytes=kv_bytes,
        combine="sum")
    predicted = [step_seconds(shape, model, profile) for shape in shapes]
    errors = np.abs(np.array(predicted) - measured) / measured
    return Calibration(
        profile, model, float(np.median(errors[sorted(held_grid)])), float(np.median(errors[sorted(held_steps)])),
        float(np.median(errors[fit])),
        [(describe(grid[i]), grid_seconds[i], predicted[i]) for i in sorted(held_grid)], len(grid), len(step_trace),
        source)


def describe_profile(p: specs.HardwareProfile) -> str:
    def share(efficiency: float | None) -> str:
        return "no fitted cost" if efficiency is None or efficiency >= 1e8 else f"{efficiency:.2f}"

    return (f"{p.name}: {p.step_overhead_s * 1e3:.2f} ms per step + {p.per_sequence_s * 1e6:.0f} us per sequence; "
            f"compute at {share(p.flops_efficiency)} of "
            f"{p.peak_flops / 1e9:.0f} GOP/s (measured GEMM), weights and activations at "
            f"{share(p.bandwidth_efficiency)} and the attention's KV reads at {share(p.kv_read_efficiency)} of "
            f"{p.memory_bandwidth / 1e9:.1f} GB/s (measured copy)")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "bf16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default="cpu-profile.json", help="where the hardware profile goes")
    parser.add_argument("--step-trace", default=None, metavar="FILE",
                        help="fit the time around the model to a server's steps (tokenmill serve --step-trace) "
                             "rather than to an in-process run's")


def main(args: argparse.Namespace) -> int:
    trace_steps = read_step_trace(args.step_trace) if args.step_trace else None
    result = calibrate(args.quantization, args.repeats, step_trace=trace_steps)
    result.profile.save(args.output)
    p = result.profile
    print(f"{result.num_grid} grid plans and {result.num_trace} whole engine steps ({result.trace_source}) timed")
    print(describe_profile(p))
    print(f"median error held out: {result.grid_error:.1%} on grid plans (model time), {result.trace_error:.1%} "
          f"on {result.trace_source} steps (whole step); {result.fit_error:.1%} on what was fitted")
    for plan, measured, predicted in result.rows:
        print(f"  {plan}: measured {measured * 1e3:.2f} ms, predicted {predicted * 1e3:.2f} ms")
    print(f"wrote {args.output}")
    return 0
