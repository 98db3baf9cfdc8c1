"""The sweep's measurements against a live server: the single stream (the SLOs' base), prefill speed, capacity
under a closed loop, and Poisson rate points cut at a deadline."""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import httpx

from tokenmill.bench import workloads
from tokenmill.bench.loadgen import ClosedLoop, arrival_times, run_closed_loop, run_load
from tokenmill.bench.stats import RequestResult, summarize
from tokenmill.bench.workloads import WorkItem
from tokenmill.model.tokenizer import Tokenizer
from tokenmill.server.metrics import metric_value
from tokenmill.sim.questions import goodput_knee


@dataclass
class ServerFacts:
    url: str
    model: str  # the served name requests must give
    max_model_len: int
    kv_capacity_tokens: int


def server_facts(url: str) -> ServerFacts:
    entry = httpx.get(url + "/v1/models").json()["data"][0]
    capacity = metric_value(httpx.get(url + "/metrics").text, "tokenmill:kv_cache_capacity_tokens")
    return ServerFacts(url, entry["id"], int(entry["max_model_len"]), int(capacity or 0))


def load(server: ServerFacts, items: list[WorkItem], rate: float = float("inf"), seed: int = 0,
         deadline: float | None = None) -> tuple[list[RequestResult], float]:
    return asyncio.run(run_load(server.url, server.model, items, rate, seed=seed, progress=False,
                                token_prompts=True, deadline=deadline))


def warm_up(server: ServerFacts, tokenizer: Tokenizer) -> None:
    """Two short requests: a server's first steps pay one-time costs (buffers, kernel dispatch)."""
    load(server, workloads.random_lengths(tokenizer, 2, 64, 8, seed=99))


@dataclass
class SingleStream:
    ttft_s: float  # median over requests of the sweep's workload, one at a time
    tpot_s: float
    prefill_tokens_per_s: float  # one long prompt alone


def single_stream(server: ServerFacts, tokenizer: Tokenizer, items: list[WorkItem],
                  prefill_tokens: int = 1024) -> SingleStream:
    ttfts, tpots = [], []
    for item in items:
        [result], _ = load(server, [item])
        if result.ttft is not None:
            ttfts.append(result.ttft)
        if result.tpot is not None:
            tpots.append(result.tpot)
    long_prompt = workloads.random_lengths(tokenizer, 1, min(prefill_tokens, server.max_model_len - 8), 1, seed=98)
    [result], _ = load(server, long_prompt)
    if not ttfts or not tpots or result.ttft is None:
        raise RuntimeError("the single-stream probe got no tokens back: is the server healthy?")
    return SingleStream(statistics.median(ttfts), statistics.median(tpots),
                        len(long_prompt[0].prompt_token_ids) / result.ttft)


@dataclass
class Capacity:
    mode: str
    max_num_seqs: int
    output_tokens_per_s: float  # streamed while the closed loop was full (after the first answer finished)
    requests_per_s: float  # output_tokens_per_s / the workload's mean output length
    window_s: float
    mean_running: float  # requests in the running batch, sampled from /metrics in the window
    mean_kv_usage: float  # share of the pool's KV blocks in use, sampled the same way


async def _closed_loop_with_metrics(server: ServerFacts, items: list[WorkItem], concurrency: int,
                                    ) -> tuple[ClosedLoop, list[tuple[float, float, float]]]:
    samples: list[tuple[float, float, float]] = []  # (time, running, kv usage)

    async def poll() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=10.0) as client:
            while True:
                text = (await client.get("/metrics")).text
                samples.append((time.perf_counter(), metric_value(text, "tokenmill:num_requests_running") or 0.0,
                                metric_value(text, "tokenmill:kv_cache_usage_perc") or 0.0))
                await asyncio.sleep(0.25)

    poller = asyncio.ensure_future(poll())
    try:
        loop = await run_closed_loop(server.url, server.model, items, concurrency)
    finally:
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
    return loop, samples


def measure_capacity(server: ServerFacts, mode: str, max_num_seqs: int, items: list[WorkItem]) -> Capacity:
    """Twice max_num_seqs clients in a closed loop over `items` (capacity_requests of them): a full batch runs
    while another waits, so a static batch always starts full. The rate counts the tokens streamed from the
    max_num_seqs-th answer's end (for static and dynamic batching: the second batch's start) to the last send (the
    start of a later batch): whole batch cycles, prefill included."""
    clients = 2 * max_num_seqs
    if len(items) < clients + 2 * max_num_seqs:
        raise ValueError("a closed loop needs capacity_requests(): a batch cycle past the clients' first requests")
    loop, samples = asyncio.run(_closed_loop_with_metrics(server, items, clients))
    since = loop.sends[clients + max_num_seqs - 1]
    rate = loop.output_rate(since)
    window = [(running, usage) for t, running, usage in samples if since <= t <= loop.end]
    mean_output = statistics.fmean(item.max_tokens for item in items)
    return Capacity(mode, max_num_seqs, rate, rate / mean_output, loop.end - since,
                    statistics.fmean(r for r, _ in window) if window else math.nan,
                    statistics.fmean(u for _, u in window) if window else math.nan)


def capacity_requests(mode: str, max_num_seqs: int) -> int:
    """How many requests measure_capacity needs: the clients' first requests, the first batch's replacements,
    then the window: for static and dynamic batching whole batch cycles, at least two and at least 64 answers (one
    batch's rate swings with its longest answer); for continuous batching (no cycles) 64 answers."""
    window = 64 if mode == "continuous" else max(2, math.ceil(64 / max_num_seqs)) * max_num_seqs
    return 3 * max_num_seqs + window


@dataclass
class RatePoint:
    multiple: float  # of the mode's capacity
    rate: float  # req/s offered
    summary: dict[str, Any]  # stats.summarize, requests cut at the deadline counted outside the SLOs
    num_requests: int
    num_cut: int
    streamed_output_tokens_per_s: float  # every streamed token (cut requests' too) over the point's duration


def deadline_for(items: list[WorkItem], arrivals_end: float, slo_ttft: float, slo_tpot: float) -> float:
    """Late enough that a request still open then could not have met the SLOs even arriving last."""
    longest = max(item.max_tokens for item in items)
    return arrivals_end + slo_ttft + slo_tpot * longest + 1.0


def points_requests(rate: float, requests_per_point: int, point_seconds: float, min_requests: int) -> int:
    """`requests_per_point`, fewer where arrivals at this rate would take longer than `point_seconds`."""
    return max(min_requests, min(requests_per_point, math.ceil(rate * point_seconds)))


def measure_rate(server: ServerFacts, items: list[WorkItem], multiple: float, rate: float, seed: int,
                 slo_ttft: float, slo_tpot: float) -> RatePoint:
    arrivals_end = max(arrival_times(items, rate, seed))
    results, duration = load(server, items, rate, seed, deadline_for(items, arrivals_end, slo_ttft, slo_tpot))
    return rate_point(multiple, rate, results, duration, slo_ttft, slo_tpot)


def rate_point(multiple: float, rate: float, results: list[RequestResult], duration: float, slo_ttft: float,
               slo_tpot: float) -> RatePoint:
    streamed = sum(len(r.chunk_times) for r in results)
    cut = sum(1 for r in results if not r.ok)
    return RatePoint(multiple, rate, summarize(results, duration, slo_ttft, slo_tpot), len(results), cut,
                     streamed / duration if duration > 0 else 0.0)


def knee_rate(points: list[RatePoint], attainment: float = 0.9) -> float | None:
    """The goodput knee's rate (sim.questions.goodput_knee), None where no rate met the SLOs."""
    knee = goodput_knee(points, attainment)
    return knee.rate if knee is not None else None
