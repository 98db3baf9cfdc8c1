"""Multi-LoRA throughput: 32 mixed requests (prompts 32-512 tokens, outputs 8-256) spread over 1, 4 and 8 adapters
(all seven projections, ranks 8, 16 and 64) against the base model alone, and the same 8 adapters served one
after another (`max_loras 1`: what llama-server does, which never batches requests whose adapters differ).

The engine is driven in-process on the bundled model with the default linear layers; adapters are random,
written in PEFT's format, and read once before timing (as a server holds them). Configurations run interleaved,
`--runs` times; the spread is over those runs. `python benchmarks/bench_lora.py [--runs N]` prints the table and
writes the "lora" section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tokenmill.bench.lora import write_random_adapter  # noqa: E402
from tokenmill.bench.machine import gemm_gflops, memory_bandwidth_gbs  # noqa: E402
from tokenmill.bench.report import machine_description, markdown_table, write_section  # noqa: E402
from tokenmill.bench.workloads import WorkItem, mixed  # noqa: E402
from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.engine.llm_engine import LLMEngine  # noqa: E402
from tokenmill.executor.model_runner import linear_mode, lora_dtype  # noqa: E402
from tokenmill.lora.request import LoRARequest  # noqa: E402
from tokenmill.model.loader import load_model  # noqa: E402
from tokenmill.model.tokenizer import Tokenizer  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402


def run(engine: LLMEngine, items: list[WorkItem], loras: list[LoRARequest | None]) -> tuple[float, float]:
    """(output tokens/s, ITL p50 in ms) of the whole workload submitted at once."""
    for lora in {lora for lora in loras if lora is not None}:  # read once, resident in host memory
        engine.add_request(None, [1, 2, 3], SamplingParams(max_tokens=1), lora_request=lora)
    while engine.has_unfinished_requests():
        engine.step()
    ids = [engine.add_request(None, {"prompt_token_ids": item.prompt_token_ids},
                              SamplingParams(temperature=0.0, max_tokens=item.max_tokens, ignore_eos=True),
                              lora_request=lora) for item, lora in zip(items, loras)]
    start = time.perf_counter()
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    elapsed = time.perf_counter() - start
    tokens = sum(len(finished[i].outputs[0].token_ids) for i in ids)
    gaps = [b - a for i in ids for t in finished[i].metrics for a, b in zip(t.token_times, t.token_times[1:])]
    return tokens / elapsed, statistics.median(gaps) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=2, help="interleaved repetitions (the spread is over them)")
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    loaded = load_model(None)
    tokenizer = Tokenizer.from_path(loaded.path, loaded.gguf_reader)
    items = mixed(tokenizer, args.requests, seed=1, output_range=(8, 256))
    # (name, adapters, rank, max_loras, max_num_seqs)
    configs: list[tuple[str, int, int, int, int]] = [("base model alone", 0, 0, 0, 64)]
    for rank in (8, 16, 64):
        for count in (1, 4, 8):
            configs.append((f"{count} adapter{'s' if count > 1 else ''}, rank {rank}", count, rank, count, 64))
    configs.append(("8 adapters, rank 16, one at a time (max_loras 1)", 8, 16, 1, 64))
    # the bound on what one-at-a-time loses: the base model held to the 4 requests each adapter has
    configs.append((f"base model, max_num_seqs {args.requests // 8}", 0, 0, 0, args.requests // 8))
    bandwidth, gflops = memory_bandwidth_gbs(), gemm_gflops("none")
    results: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        adapters: dict[int, list[LoRARequest]] = {}
        for rank in (8, 16, 64):
            adapters[rank] = []
            for i in range(8):
                path = Path(tmp) / f"r{rank}-{i}"
                write_random_adapter(path, loaded.config, rank, seed=rank * 100 + i)
                adapters[rank].append(LoRARequest(f"r{rank}-{i}", rank * 100 + i + 1, str(path)))
        for _ in range(args.runs):
            for name, count, rank, max_loras, max_num_seqs in configs:
                config = EngineConfig(enable_lora=count > 0, max_loras=max(1, max_loras), max_lora_rank=max(rank, 1),
                                      max_cpu_loras=max(8, max_loras), max_num_seqs=max_num_seqs)
                engine = LLMEngine.from_loaded(config, loaded, tokenizer)
                loras: list[LoRARequest | None] = [None] * len(items) if count == 0 else [
                    adapters[rank][i % count] for i in range(len(items))]
                results.setdefault(name, []).append(run(engine, items, loras))
                print(f"{name}: {results[name][-1][0]:.1f} tok/s, ITL p50 {results[name][-1][1]:.1f} ms", flush=True)
                del engine
    base = statistics.median(r[0] for r in results["base model alone"])
    serial = statistics.median(r[0] for r in results["8 adapters, rank 16, one at a time (max_loras 1)"])
    rows = []
    for name, *_ in configs:
        rates = [r[0] for r in results[name]]
        median = statistics.median(rates)
        rows.append([name, f"{median:.1f}", f"{min(rates):.0f}-{max(rates):.0f}", f"{median / base:.2f}x",
                     f"{statistics.median(r[1] for r in results[name]):.1f}"])
    mixed_r16 = statistics.median(r[0] for r in results["8 adapters, rank 16"])
    narrow = statistics.median(r[0] for r in results[f"base model, max_num_seqs {args.requests // 8}"])
    table = markdown_table(["requests over", "output tok/s (median)", "spread", "vs base model", "ITL p50 (ms)"],
                           rows)
    body = (f"## Multi-LoRA: adapters mixed in one batch\n\n{machine_description()}; linear layers "
            f"`{engine_mode()}`, adapters' weights `{str(lora_dtype(EngineConfig())).removeprefix('torch.')}`; "
            f"{args.requests} `mixed` requests (prompts 32-512, outputs 8-256, submitted at once), adapters "
            f"round-robin; {args.runs} interleaved runs; this machine in the same run: "
            f"{bandwidth:.1f} GB/s memory, {gflops:.0f} GFLOP/s float32 GEMM.\n"
            f"`python benchmarks/bench_lora.py --runs {args.runs}`\n\n{table}\n\n"
            f"8 adapters at rank 16 mixed in one batch: {mixed_r16 / base:.2f}x the base model's throughput, "
            f"{mixed_r16 / serial:.2f}x serving them one adapter at a time. On this machine batching itself gains "
            f"little: the base model runs {base / narrow:.2f}x faster at {args.requests} concurrent requests than at "
            f"{args.requests // 8}; the rest of the gap is one-at-a-time's tails (each adapter's longest request "
            f"runs nearly alone).\n")
    print(body)
    write_section("lora", body)


def engine_mode() -> str:
    return linear_mode(EngineConfig())


if __name__ == "__main__":
    main()
