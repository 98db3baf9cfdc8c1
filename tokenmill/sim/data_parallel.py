"""Data-parallel replicas on one simulated clock: N real engine cores, each with its own cost-model executor and
KV pool, behind the real router policies (`tokenmill/router`), fed the KV events and loads the engines would
publish. Answers what prefix-aware routing buys over round-robin for a workload, at any scale."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.bench.stats import RequestResult, summarize
from tokenmill.bench.workloads import WorkItem
from tokenmill.engine.core import EngineCore
from tokenmill.request import Request
from tokenmill.router.policy import make_router
from tokenmill.sampling_params import SamplingParams
from tokenmill.sim.executor import SimClock, SimExecutor
from tokenmill.sim.simulator import Simulation, request_result


@dataclass
class DataParallelResult:
    summary: dict[str, Any]
    results: list[RequestResult]
    prefix_hit_rate: float  # prompt tokens found in the prefix caches, all replicas
    requests_per_replica: list[int]
    decisions: Counter[str]  # the router's reasons: prefix, load, round-robin
    wall_seconds: float


class _Replica:
    def __init__(self, core: EngineCore, clock: SimClock) -> None:
        self.core = core
        self.clock = clock
        self.num_requests = 0


class DataParallelSimulation:
    def __init__(self, replica: Simulation, num_replicas: int, router: str = "prefix-aware") -> None:
        """`replica`: one replica's model, hardware, engine settings and KV pool, copied `num_replicas` times."""
        self.replica, self.num_replicas, self.router_name = replica, num_replicas, router

    def run(self, items: Sequence[WorkItem], arrivals: Sequence[float], slo_ttft: float | None = None,
            slo_tpot: float | None = None) -> DataParallelResult:
        """Events in time order: an arrival is routed once every replica has run the steps that start before
        it (so the router sees their loads and caches as of then); otherwise the replica whose next step starts
        first runs it. Each replica's clock is when its current step ends."""
        wall_start = time.perf_counter()
        replicas = []
        for _ in range(self.num_replicas):
            clock = SimClock()
            setup = self.replica
            executor = SimExecutor(setup.model, setup.hw, clock, setup.num_kv_blocks, setup.tensor_parallel)
            core = EngineCore(setup.config, executor, setup.max_model_len, clock)
            core.kv.pool.events = []
            replicas.append(_Replica(core, clock))
        router = make_router(self.router_name, self.num_replicas, self.replica.config.block_size)
        decisions: Counter[str] = Counter()
        order = sorted(range(len(items)), key=lambda i: arrivals[i])
        requests: list[Request] = []
        next_item = 0
        while True:
            busy = [r for r in replicas if r.core.has_unfinished_requests()]
            next_step = min((r.clock.now for r in busy), default=float("inf"))
            next_arrival = arrivals[order[next_item]] if next_item < len(order) else float("inf")
            if next_step == next_arrival == float("inf"):
                break
            if next_arrival <= next_step:
                index = order[next_item]
                next_item += 1
                for i, replica in enumerate(replicas):
                    router.apply_events(i, replica.core.kv.pool.events or [])
                    replica.core.kv.pool.events = []
                    router.set_load(i, replica.core.load_tokens())
                decision = router.route(items[index].prompt_token_ids)
                decisions[decision.reason] += 1
                chosen = replicas[decision.replica]
                if not chosen.core.has_unfinished_requests():
                    chosen.clock.now = max(chosen.clock.now, next_arrival)  # idle until this arrival
                request = Request(str(index), items[index].prompt_token_ids,
                                  SamplingParams(max_tokens=items[index].max_tokens, ignore_eos=True,
                                                 temperature=0), arrival_time=next_arrival)
                chosen.core.add_request(request)
                chosen.num_requests += 1
                requests.append(request)
            else:
                min(busy, key=lambda r: r.clock.now).core.step()
        results = [request_result(r) for r in sorted(requests, key=lambda r: int(r.request_id))]
        start = min(arrivals) if arrivals else 0.0
        end = max(r.clock.now for r in replicas)
        queries = sum(r.core.kv.prefix_queries for r in replicas)
        hits = sum(r.core.kv.prefix_hits for r in replicas)
        return DataParallelResult(summarize(results, end - start, slo_ttft, slo_tpot), results,
                                  hits / queries if queries else 0.0, [r.num_requests for r in replicas],
                                  decisions, time.perf_counter() - wall_start)
