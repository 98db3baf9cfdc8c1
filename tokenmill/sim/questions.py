"""The questions the simulator answers: a sweep of one setting (request rate, with the goodput knee; batching
mode; max_num_batched_tokens; max_num_seqs) and capacity (replicas needed for a target rate under SLOs)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from tokenmill.bench.loadgen import arrival_times
from tokenmill.bench.workloads import WorkItem
from tokenmill.sim.simulator import SimResult, Simulation

# What `sweep` can vary: the request rate, or an engine setting (vLLM's flag names).
SWEEPABLE = {
    "request-rate": float,
    "batching": str,
    "max-num-batched-tokens": int,
    "max-num-seqs": int,
    "target-itl-ms": float,  # the self-setting prompt budget (core/token_budget.py), fitted on simulated steps
}


# The requests to send at a rate (a run at a higher rate needs more of them to reach a steady state).
Workload = Callable[[float], Sequence[WorkItem]]


def steady_workload(make: Callable[[int], Sequence[WorkItem]], num_requests: int, duration: float) -> Workload:
    """At least `num_requests`, and enough that arrivals span `duration` seconds: a short run under overload
    ends before the queue has grown, and would hide the knee."""
    def items(rate: float) -> Sequence[WorkItem]:
        return make(num_requests if rate == float("inf") else max(num_requests, math.ceil(rate * duration)))

    return items


@dataclass
class SweepPoint:
    value: Any
    rate: float
    result: SimResult

    @property
    def summary(self) -> dict[str, Any]:
        return self.result.summary


def sweep(simulation: Simulation, workload: Workload, parameter: str, values: Sequence[Any],
          rate: float, seed: int = 0, slo_ttft: float | None = None, slo_tpot: float | None = None,
          progress: Callable[[SweepPoint], None] | None = None) -> list[SweepPoint]:
    """One simulation per value, the rest unchanged: the same requests and arrivals unless the rate is what
    varies."""
    if parameter not in SWEEPABLE:
        raise ValueError(f"cannot sweep {parameter!r}: one of {sorted(SWEEPABLE)}")
    points = []
    for value in values:
        value = SWEEPABLE[parameter](value)
        point_rate = value if parameter == "request-rate" else rate
        point_sim = simulation
        if parameter != "request-rate":
            point_sim = simulation.with_config(dataclasses.replace(
                simulation.config, **{parameter.replace("-", "_"): value}))
        items = workload(point_rate)
        result = point_sim.run(items, arrival_times(items, point_rate, seed), slo_ttft, slo_tpot)
        points.append(SweepPoint(value, point_rate, result))
        if progress:
            progress(points[-1])
    return points


class RatedPoint(Protocol):
    """A point of a rate sweep: the simulator's (SweepPoint) or a measured one (bench/sweep_load.RatePoint)."""

    @property
    def rate(self) -> float: ...

    @property
    def summary(self) -> dict[str, Any]: ...


Point = TypeVar("Point", bound=RatedPoint)


def goodput_knee(points: Sequence[Point], attainment: float = 0.9) -> Point | None:
    """The highest request rate whose requests meet the SLOs at least `attainment` of the time, below the first
    rate that does not (past the knee, queues grow and goodput falls away from the offered rate)."""
    knee = None
    for point in sorted(points, key=lambda p: p.rate):
        if point.summary["good_share"] < attainment:
            break
        knee = point
    return knee


@dataclass
class Capacity:
    replicas: int | None  # None: not reached within max_replicas
    per_replica_rate: float
    result: SimResult | None  # one replica at its share of the rate
    tried: list[tuple[int, float]]  # (replicas, share of requests within the SLOs)


def capacity(simulation: Simulation, workload: Workload, target_rate: float, slo_ttft: float | None,
             slo_tpot: float | None, attainment: float = 0.9, seed: int = 0, max_replicas: int = 1024) -> Capacity:
    """Fewest replicas for `target_rate` req/s with `attainment` of requests within the SLOs. The requests are
    spread evenly and independently (round-robin or random routing: each replica sees a Poisson stream at
    target_rate / replicas), so one replica is simulated at its share; prefix affinity is not modelled."""
    if slo_ttft is None and slo_tpot is None:
        raise ValueError("capacity needs an SLO: --slo-ttft and/or --slo-tpot")
    tried: dict[int, tuple[float, SimResult]] = {}

    def meets(replicas: int) -> bool:
        if replicas not in tried:
            rate = target_rate / replicas
            items = workload(rate)
            result = simulation.run(items, arrival_times(items, rate, seed), slo_ttft, slo_tpot)
            tried[replicas] = (result.summary["good_share"], result)
        return tried[replicas][0] >= attainment

    high = 1  # double until enough, then bisect between the last too few and the first enough
    while not meets(high):
        if high >= max_replicas:
            return Capacity(None, target_rate / high, tried[high][1], sorted((n, s) for n, (s, _) in tried.items()))
        high = min(2 * high, max_replicas)
    low = high // 2
    while high - low > 1:
        middle = (low + high) // 2
        if meets(middle):
            high = middle
        else:
            low = middle
    return Capacity(high, target_rate / high, tried[high][1], sorted((n, s) for n, (s, _) in tried.items()))
