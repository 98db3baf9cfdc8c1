"""Offline (in-process) throughput runs on an engine, with KV statistics per step, and the peers' offline
protocol (the one `../shared/peers/openvino_bench.py` runs) on an `LLM`."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from tokenmill.bench.workloads import WorkItem
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.llm import LLM
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


@dataclass
class OfflineRates:
    """Output tokens/s of the peers' offline protocol, one value per repeat (warm-up excluded)."""

    single: list[float]
    batch: list[float]
    prefix_hit_tokens: int  # prompt tokens served from the prefix cache over the run: 0 by construction


def peer_protocol_llm(quantization: str, model: str | None = None) -> LLM:
    """An `LLM` set up as the offline peers run: prefix caching off (OpenVINO GenAI's benchmark sets
    `enable_prefix_caching = False`), so repeating the same prompts measures prefill every time."""
    return LLM(model, quantization=quantization, max_num_seqs=64, enable_prefix_caching=False)


def peer_protocol_rates(llm: LLM, story: str, prompts: list[str], repeats: int = 3, single_tokens: int = 256,
                        batch_tokens: int = 128) -> OfflineRates:
    """One greedy stream of `single_tokens` from `story`, then all `prompts` at once with `batch_tokens` each,
    EOS ignored, `repeats` times each after one short warm-up (not counted)."""
    if llm.engine.config.enable_prefix_caching:
        raise ValueError("the peers' offline protocol runs with prefix caching off: use peer_protocol_llm()")
    llm.generate([story], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)

    def rate(batch: list[str], tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)

    single = [rate([story], single_tokens) for _ in range(repeats)]
    batch = [rate(prompts, batch_tokens) for _ in range(repeats)]
    return OfflineRates(single, batch, llm.engine.core.kv.prefix_hits)
