"""The sweep's scenarios beside the batching modes: a long prompt arriving among decoding streams (chunked prefill
on and off), a shared preamble (prefix caching on and off), and KV memory held versus used (paged or reserved)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenmill.bench import workloads
from tokenmill.bench.offline import run_offline
from tokenmill.bench.stats import RequestResult, summarize
from tokenmill.bench.sweep_load import ServerFacts, SingleStream, load, warm_up
from tokenmill.bench.workloads import WorkItem
from tokenmill.config import BatchingMode, EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.model.loader import load_model
from tokenmill.model.tokenizer import Tokenizer
from tokenmill.server.metrics import metric_value

# (flags) -> a live server's facts, started and stopped around the with-block
Launch = Callable[..., AbstractContextManager[ServerFacts]]

# ------------------------------------------------------------------ long prompt among decoding streams


@dataclass
class InterferencePlan:
    long_prompt: int  # tokens: its prefill alone takes about `target_prefill_s` here
    estimated_prefill_s: float
    short_output: int  # the short streams decode this long: past the long prompt's first token
    arrival_s: float  # when the long prompt arrives (the short streams start at 0)


def plan_interference(single: SingleStream, max_model_len: int, target_prefill_s: float = 2.0,
                      arrival_s: float = 1.5) -> InterferencePlan:
    """A long prompt sized from the measured prefill speed (25% over, attention makes it slower still), and
    short streams long enough to outlast its prefill chunked in small pieces (2.5x the estimate)."""
    long_prompt = min(max_model_len - 64, 64 * math.ceil(1.25 * target_prefill_s * single.prefill_tokens_per_s / 64))
    estimate = long_prompt / single.prefill_tokens_per_s
    short_output = math.ceil((arrival_s + 2.5 * estimate + 1.5) / (1.3 * single.tpot_s))
    return InterferencePlan(long_prompt, estimate, min(short_output, max_model_len - 64), arrival_s)


def stream_gaps(results: list[RequestResult]) -> list[tuple[float, float]]:
    """(previous token time, token time) of every consecutive pair in the short streams (all but the last)."""
    return [(a, b) for r in results[:-1] for a, b in zip(r.chunk_times, r.chunk_times[1:])]


def worst_gap_during_long_prefill(results: list[RequestResult]) -> float:
    """The longest stall of a short stream between the long prompt's arrival (the last request) and its first
    token (+0.5 s)."""
    long_result = results[-1]
    end = long_result.start + (long_result.ttft or 0.0) + 0.5
    return max((b - a for a, b in stream_gaps(results) if b >= long_result.start and a <= end), default=0.0)


def overlap_problem(results: list[RequestResult]) -> str | None:
    """Why the run measured nothing, or None: every short stream must be decoding when the long prompt arrives
    and still be decoding after its first token."""
    long_result = results[-1]
    if not long_result.ok or long_result.ttft is None:
        return f"the long prompt failed ({long_result.error})"
    first_token = long_result.start + long_result.ttft
    for r in results[:-1]:
        if not r.chunk_times or r.chunk_times[0] >= long_result.start:
            return "a short stream had not started when the long prompt arrived"
        if r.chunk_times[-1] <= first_token:
            return "a short stream ended before the long prompt's first token"
    return None


@dataclass
class InterferenceRun:
    budget: int
    worst_gap: float
    median_gap_before: float
    long_ttft: float
    problem: str | None  # why it is no measurement, if it is not
    timeline: list[tuple[float, float]] = field(default_factory=list)  # (s since the long prompt, gap)


def interference(launch: Launch, tokenizer: Tokenizer, plan: InterferencePlan, seed: int) -> dict[str, InterferenceRun]:
    items = workloads.long_interference(tokenizer, seed, short_output=plan.short_output,
                                        long_prompt=plan.long_prompt, long_arrival=plan.arrival_s)
    unchunked = max(4096, plan.long_prompt + 64)
    configs = [("chunked, budget 256", 256), ("chunked, budget 1024", 1024), ("no chunking", unchunked)]
    out = {}
    for name, budget in configs:
        with launch("--max-num-batched-tokens", str(budget), "--no-prefix-caching") as server:
            warm_up(server, tokenizer)
            results, _ = load(server, items)
        long_result = results[-1]
        pairs = stream_gaps(results)
        gaps_before = [b - a for a, b in pairs if b < long_result.start]
        out[name] = InterferenceRun(budget, worst_gap_during_long_prefill(results),
                                    statistics.median(gaps_before) if gaps_before else math.nan,
                                    long_result.ttft or math.nan, overlap_problem(results),
                                    [(b - long_result.start, b - a) for a, b in pairs])
    return out


# ------------------------------------------------------------------ prefix caching


@dataclass
class PrefixRun:
    summary: dict[str, Any]
    hit_rate: float
    ttfts: list[float]


def prefix_caching(launch: Launch, tokenizer: Tokenizer, num_requests: int, rate: float, prefix_len: int,
                   seed: int) -> dict[str, PrefixRun]:
    items = workloads.shared_prefix(tokenizer, num_requests, seed, prefix_len=prefix_len)
    out = {}
    for caching in (False, True):
        with launch(*([] if caching else ["--no-prefix-caching"])) as server:
            warm_up(server, tokenizer)
            results, duration = load(server, items, rate, seed)
            text = httpx.get(server.url + "/metrics").text
        queries = metric_value(text, "tokenmill:prefix_cache_queries_total") or 0.0
        hits = metric_value(text, "tokenmill:prefix_cache_hits_total") or 0.0
        out["on" if caching else "off"] = PrefixRun(summarize(results, duration), hits / queries if queries else 0.0,
                                                    sorted(r.ttft for r in results if r.ttft is not None))
    return out


# ------------------------------------------------------------------ KV memory


def kv_memory(model_path: str | None, tokenizer: Tokenizer, items: list[WorkItem],
              batch_sizes: dict[BatchingMode, int]) -> dict[str, dict[str, float]]:
    """Offline, each mode at the batch size the sweep chose for it: the share of held KV slots that hold real
    tokens (static batching reserves prompt + max_tokens up front; paged allocation takes blocks as tokens come)."""
    loaded = load_model(model_path)
    out: dict[str, dict[str, float]] = {}
    for mode, max_num_seqs in batch_sizes.items():
        config = EngineConfig(batching=mode, max_num_seqs=max_num_seqs, enable_prefix_caching=False)
        out[mode] = run_offline(LLMEngine.from_loaded(config, loaded, tokenizer), items)
    return out

