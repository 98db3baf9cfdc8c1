"""The simulator's prediction of the sweep's table: `tokenmill sim calibrate` fitted on this machine (a grid of
plans timed in-process and the steps the continuous server took during the sweep), then every mode's capacity
and rate points run through the real scheduler on a simulated clock, with the same requests and arrivals."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tokenmill.bench.loadgen import arrival_times
from tokenmill.bench.stats import RequestResult
from tokenmill.bench.sweep_load import RatePoint, deadline_for, rate_point
from tokenmill.bench.workloads import WorkItem
from tokenmill.config import BatchingMode, EngineConfig
from tokenmill.sim.calibrate import Calibration, calibrate
from tokenmill.sim.simulator import Simulation
from tokenmill.sim.trace import read_step_trace


@dataclass
class SimulatedMode:
    output_tokens_per_s: float  # at saturation, counted as the measured closed loop counts it
    points: list[RatePoint]


def calibrated(model_path: str | None, step_trace_path: str, repeats: int = 3) -> Calibration:
    return calibrate(repeats=repeats, step_trace=read_step_trace(step_trace_path), model_path=model_path)


def simulation(calibration: Calibration, mode: BatchingMode, max_num_seqs: int, max_model_len: int,
               num_kv_blocks: int) -> Simulation:
    config = EngineConfig(batching=mode, max_num_seqs=max_num_seqs, enable_prefix_caching=False)
    return Simulation(calibration.model, calibration.profile, config, max_model_len=max_model_len,
                      num_kv_blocks=num_kv_blocks)


def saturated_rate(sim: Simulation, items: list[WorkItem]) -> float:
    """All items queued at once keep a full batch running and another waiting, as measure_capacity's closed loop
    does: count the tokens between the same two answers' ends (the max_num_seqs-th and the one that would have
    made the closed loop send its last request)."""
    result = sim.run(items, [0.0] * len(items))
    ends = sorted(r.start + r.e2e for r in result.results if r.e2e is not None)
    batch = sim.config.max_num_seqs
    last = len(items) - 2 * batch  # answers the closed loop saw before its last send
    if last <= batch or len(ends) < last:
        return math.nan
    since, until = ends[batch - 1], ends[last - 1]
    tokens = sum(1 for r in result.results for t in r.chunk_times if since <= t <= until)
    return tokens / (until - since) if until > since else math.nan


def cut_at(results: list[RequestResult], deadline: float) -> list[RequestResult]:
    """What the load generator would have seen with the same deadline (seconds after the first arrival)."""
    out = []
    for r in results:
        if r.e2e is not None and r.start + r.e2e <= deadline:
            out.append(r)
            continue
        times = [t for t in r.chunk_times if t <= deadline]
        ttft = r.ttft if times else None
        out.append(dataclasses.replace(r, ok=False, chunk_times=times, ttft=ttft, e2e=None,
                                       output_tokens=len(times), error="cut at the deadline"))
    return out


def simulate_points(sim: Simulation, point_items: list[list[WorkItem]], measured: list[RatePoint], seed: int,
                    slo_ttft: float, slo_tpot: float) -> list[RatePoint]:
    out = []
    for i, (items, point) in enumerate(zip(point_items, measured)):
        arrivals = arrival_times(items, point.rate, seed + i)
        deadline = deadline_for(items, max(arrivals), slo_ttft, slo_tpot)
        result = sim.run(items, arrivals, slo_ttft, slo_tpot)
        results = cut_at(result.results, deadline)
        duration = min(deadline, max((t for r in results for t in r.chunk_times), default=0.0))
        out.append(rate_point(point.multiple, point.rate, results, duration, slo_ttft, slo_tpot))
    return out
