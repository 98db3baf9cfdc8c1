"""`tokenmill sim calibrate`: time real model steps of the local engine over a grid of plans, fit the cost
model's factors to them, check the fit on held-out plans, and save a hardware profile (JSON)."""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass

import numpy as np

from tokenmill.bench.machine import gemm_gflops, memory_bandwidth_gbs
from tokenmill.config import EngineConfig
from tokenmill.core.outputs import ScheduledRequest, SchedulerOutput
from tokenmill.executor.model_runner import ModelRunner
from tokenmill.model.loader import load_model
from tokenmill.sampling_params import SamplingParams
from tokenmill.sim import specs
from tokenmill.sim.cost_model import StepShape, step_cost, step_seconds

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


@dataclass
class Calibration:
    profile: specs.HardwareProfile
    fit_error: float  # median |predicted - measured| / measured on the plans fitted
    held_out_error: float  # the same on plans left out of the fit
    rows: list[tuple[str, float, float]]  # (plan, measured s, predicted s) of the held-out plans


def describe(shape: StepShape) -> str:
    new = [n for n, _, _ in shape.sequences]
    decodes = sum(1 for n in new if n == 1)
    chunks = [n for n in new if n > 1]
    context = max(b for _, b, _ in shape.sequences)
    return f"{decodes} decodes + chunks {chunks}, context up to {context}"


def calibrate(quantization: str = "auto", repeats: int = 5, seed: int = 0) -> Calibration:
    loaded = load_model(None)
    model = specs.model("smollm2-135m")
    shapes = plan_shapes()
    config = EngineConfig(quantization=quantization)
    config.num_kv_blocks = blocks_needed(shapes, config.block_size)
    runner = ModelRunner(config, loaded.config, loaded.weights)
    weight_bytes = {"int8": 1.0, "bf16": 2.0}.get(runner.quantization, 4.0)
    measured = []
    for shape in shapes:
        plan = synthetic_plan(shape, config.block_size)
        runner.execute(plan)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            runner.execute(plan)
            times.append(time.perf_counter() - start)
        measured.append(statistics.median(times))
    rng = np.random.default_rng(seed)
    held_out = set(rng.choice(len(shapes), size=len(shapes) // 4, replace=False).tolist())
    fit = [i for i in range(len(shapes)) if i not in held_out]
    peak = gemm_gflops(runner.quantization) * 1e9
    bandwidth = memory_bandwidth_gbs() * 1e9
    features = np.array([[1.0, len(s.sequences), c.flops / peak, c.bytes / bandwidth]
                         for s in shapes for c in [step_cost(s, model, weight_bytes, 4.0)]])
    target = np.array(measured)
    # relative least squares (each plan weighs the same whatever its size), coefficients kept non-negative
    active = list(range(4))
    while True:
        weights = 1.0 / target[fit]
        coef, *_ = np.linalg.lstsq(features[fit][:, active] * weights[:, None], target[fit] * weights, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        del active[int(np.argmin(coef))]
    full = np.zeros(4)
    full[active] = np.maximum(coef, 0)
    profile = specs.HardwareProfile(
        name=f"cpu-{runner.quantization}", peak_flops=peak, memory_bandwidth=bandwidth, memory_bytes=0.0,
        flops_efficiency=1.0 / full[2] if full[2] > 0 else 1e9, bandwidth_efficiency=1.0 / full[3] if full[3] > 0
        else 1e9, step_overhead_s=float(full[0]), per_sequence_s=float(full[1]), weight_bytes=weight_bytes,
        kv_bytes=4.0, combine="sum")
    predicted = [step_seconds(s, model, profile) for s in shapes]
    errors = [abs(p - m) / m for p, m in zip(predicted, measured)]
    return Calibration(profile, float(np.median([errors[i] for i in fit])),
                       float(np.median([errors[i] for i in held_out])),
                       [(describe(shapes[i]), measured[i], predicted[i]) for i in sorted(held_out)])


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "bf16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default="cpu-profile.json", help="where the hardware profile goes")


def main(args: argparse.Namespace) -> int:
    result = calibrate(args.quantization, args.repeats)
    result.profile.save(args.output)
    p = result.profile
    print(f"{p.name}: overhead {p.step_overhead_s * 1e3:.2f} ms/step + {p.per_sequence_s * 1e6:.0f} us/sequence, "
          f"compute at {p.flops_efficiency:.2f} of {p.peak_flops / 1e9:.0f} GFLOP/s, memory at "
          f"{p.bandwidth_efficiency:.2f} of {p.memory_bandwidth / 1e9:.1f} GB/s")
    print(f"median error: {result.fit_error:.1%} on the fitted plans, {result.held_out_error:.1%} held out")
    for plan, measured, predicted in result.rows:
        print(f"  {plan}: measured {measured * 1e3:.2f} ms, predicted {predicted * 1e3:.2f} ms")
    print(f"wrote {args.output}")
    return 0
