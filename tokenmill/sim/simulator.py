"""Runs a workload through the real engine core (scheduler, KV cache manager, request lifecycle) with the
cost-model executor and a simulated clock, and reports what `tokenmill bench serve` reports."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.bench.stats import RequestResult, summarize
from tokenmill.bench.workloads import WorkItem
from tokenmill.config import EngineConfig
from tokenmill.engine.core import EngineCore
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.sim.cost_model import chunks_seconds
from tokenmill.sim.executor import SimClock, SimExecutor, kv_blocks_for
from tokenmill.sim.specs import HardwareProfile, ModelSpec


@dataclass
class SimResult:
    summary: dict[str, Any]
    results: list[RequestResult]
    num_steps: int
    busy_seconds: float  # simulated seconds spent in steps
    num_preemptions: int
    peak_kv_usage: float
    wall_seconds: float
    kv_blocks: int
    step_seconds: list[float] = field(default_factory=list)

    @property
    def requests_per_wall_second(self) -> float:
        return len(self.results) / self.wall_seconds if self.wall_seconds > 0 else float("inf")


class Simulation:
    def __init__(self, model: ModelSpec, hw: HardwareProfile, config: EngineConfig, tensor_parallel: int = 1,
                 max_model_len: int = 8192, num_kv_blocks: int | None = None) -> None:
        self.model = model
        self.hw = hw
        self.config = config
        self.tensor_parallel = tensor_parallel
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks or config.num_kv_blocks or kv_blocks_for(
            model, hw, config.block_size, tensor_parallel, kv_cache_memory_gb=config.kv_cache_memory_gb)

    def with_config(self, config: EngineConfig) -> Simulation:
        """The same model, hardware and KV pool under other engine settings."""
        return Simulation(self.model, self.hw, config, self.tensor_parallel, self.max_model_len, self.num_kv_blocks)

    def run(self, items: Sequence[WorkItem], arrivals: Sequence[float], slo_ttft: float | None = None,
            slo_tpot: float | None = None) -> SimResult:
        """Each item arrives at its time (seconds); every request generates exactly its max_tokens."""
        wall_start = time.perf_counter()
        clock = SimClock()
        executor = SimExecutor(self.model, self.hw, clock, self.num_kv_blocks, self.tensor_parallel)
        core = EngineCore(self.config, executor, self.max_model_len, clock)
        if core.scheduler.token_budget is not None:  # the profile is known here: the predictor starts from it
            core.scheduler.token_budget.warm_start(
                lambda chunks: chunks_seconds(chunks, self.model, self.hw, self.tensor_parallel))

        def idle_until(t: float) -> None:
            clock.now = max(clock.now, t)

        run = drive(core, items, arrivals, clock, idle_until)
        start = min(arrivals) if arrivals else 0.0
        summary = summarize(run.results, clock.now - start, slo_ttft, slo_tpot)
        return SimResult(summary, run.results, executor.num_steps, executor.busy_seconds,
                         core.scheduler.total_preemptions, run.peak_kv_usage, time.perf_counter() - wall_start,
                         self.num_kv_blocks, run.step_seconds)


@dataclass
class WorkloadRun:
    results: list[RequestResult]
    step_seconds: list[float]
    peak_kv_usage: float


def drive(core: EngineCore, items: Sequence[WorkItem], arrivals: Sequence[float], clock: Callable[[], float],
          idle_until: Callable[[float], None]) -> WorkloadRun:
    """Feed the items to the engine core at their arrival times (on `clock`) and step it until all are done;
    `idle_until` passes the time when nothing runs (a simulated clock jumps, a real one sleeps). Every request
    generates exactly its max_tokens, greedy."""
    order = sorted(range(len(items)), key=lambda i: arrivals[i])
    requests: list[Request] = []
    next_item = 0
    peak_kv = 0.0
    step_seconds = []
    while next_item < len(order) or core.has_unfinished_requests():
        if not core.has_unfinished_requests():
            idle_until(arrivals[order[next_item]])
        while next_item < len(order) and arrivals[order[next_item]] <= clock():
            item = items[order[next_item]]
            request = Request(str(order[next_item]), item.prompt_token_ids,
                              SamplingParams(max_tokens=item.max_tokens, ignore_eos=True, temperature=0),
                              arrival_time=arrivals[order[next_item]])
            core.add_request(request)
            requests.append(request)
            next_item += 1
        before = clock()
        core.step()
        step_seconds.append(clock() - before)
        peak_kv = max(peak_kv, core.kv.usage())
    results = [request_result(r) for r in sorted(requests, key=lambda r: int(r.request_id))]
    return WorkloadRun(results, step_seconds, peak_kv)


def request_result(request: Request) -> RequestResult:
    times = request.times
    first, finished = times.first_token, times.finished
    return RequestResult(
        ok=finished is not None, prompt_tokens=request.num_prompt_tokens, output_tokens=request.num_output_tokens,
        start=times.arrival, ttft=None if first is None else first - times.arrival,
        e2e=None if finished is None else finished - times.arrival, chunk_times=list(times.token_times))
