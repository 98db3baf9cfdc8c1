"""Offline (in-process) throughput runs on an engine, with KV statistics per step."""

from __future__ import annotations

import statistics
import time

from tokenmill.bench.workloads import WorkItem
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams


def run_offline(engine: LLMEngine, items: list[WorkItem]) -> dict[str, float]:
    for i, item in enumerate(items):
        engine.add_request(str(i), {"prompt_token_ids": item.prompt_token_ids},
                           SamplingParams(temperature=0.0, max_tokens=item.max_tokens, ignore_eos=True))
    real_share: list[float] = []
    usage: list[float] = []
    output_tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            output_tokens += sum(len(c.delta_token_ids) for c in out.outputs)
        stats = engine.core.last_step.stats if engine.core.last_step else None
        if stats and stats.kv_reserved_tokens:
            real_share.append(stats.kv_tokens / stats.kv_reserved_tokens)
            usage.append(stats.kv_usage)
    elapsed = time.perf_counter() - start
    kv = engine.core.kv
    return {
        "seconds": elapsed,
        "output_tokens": output_tokens,
        "tokens_per_s": output_tokens / elapsed,
        "requests_per_s": len(items) / elapsed,
        "kv_real_share": statistics.fmean(real_share) if real_share else 0.0,
        "kv_usage": statistics.fmean(usage) if usage else 0.0,
        "steps": engine.core.num_steps,
        "prefix_hit_rate": kv.prefix_hits / kv.prefix_queries if kv.prefix_queries else 0.0,
        "preemptions": engine.scheduler.total_preemptions,
    }
