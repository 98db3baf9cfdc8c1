"""Offline throughput of static vs dynamic vs continuous batching on the bundled model, the share of KV memory
holding real tokens in each mode, and the prefix-cache hit rate on a shared-prefix workload.

Same model, kernels and workload in every mode (they differ only in the scheduler's batching policy).
`python benchmarks/bench_batching.py` prints the numbers and writes the "batching" section of
docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse

from tokenmill.bench.offline import run_offline
from tokenmill.bench.report import machine_description, markdown_table, write_section
from tokenmill.bench.workloads import mixed, shared_prefix
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.model.loader import LoadedModel, load_model
from tokenmill.model.tokenizer import Tokenizer


def engine_for(loaded: LoadedModel, tokenizer: Tokenizer, **config: object) -> LLMEngine:
    return LLMEngine.from_loaded(EngineConfig(**config), loaded, tokenizer)  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    loaded = load_model(None)
    tokenizer = Tokenizer.from_path(loaded.path, loaded.gguf_reader)
    items = mixed(tokenizer, args.num_requests, args.seed)
    out_lens = sorted(i.max_tokens for i in items)
    print(f"mixed workload: {len(items)} requests, prompts {min(len(i.prompt_token_ids) for i in items)}-"
          f"{max(len(i.prompt_token_ids) for i in items)} tokens, outputs median {out_lens[len(out_lens) // 2]}, "
          f"max {out_lens[-1]}, total {sum(out_lens)}")
    results = {}
    for mode in ("static", "dynamic", "continuous"):
        engine = engine_for(loaded, tokenizer, batching=mode, max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)
        results[mode] = run_offline(engine, items)
        r = results[mode]
        print(f"{mode:>10}: {r['tokens_per_s']:7.1f} output tok/s, {r['requests_per_s']:.3f} req/s, "
              f"{r['seconds']:.1f} s, KV real-token share {r['kv_real_share']:.1%}", flush=True)

    prefix_items = shared_prefix(tokenizer, args.num_requests, args.seed)
    prefix_results = {}
    for caching in (False, True):
        engine = engine_for(loaded, tokenizer, max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=caching)
        prefix_results[caching] = run_offline(engine, prefix_items)
        r = prefix_results[caching]
        print(f"shared-prefix, caching {'on ' if caching else 'off'}: {r['seconds']:.1f} s, "
              f"hit rate {r['prefix_hit_rate']:.1%}", flush=True)

    speedup = results["continuous"]["tokens_per_s"] / results["static"]["tokens_per_s"]
    rows = [[mode, round(r["tokens_per_s"], 1), round(r["requests_per_s"], 3), round(r["seconds"], 1), r["steps"],
             f"{r['kv_real_share']:.1%}", f"{r['kv_usage']:.1%}", r["preemptions"]]
            for mode, r in results.items()]
    off, on = prefix_results[False], prefix_results[True]
    body = "\n".join([
        "## Batching modes, offline (`python benchmarks/bench_batching.py`)",
        "",
        f"Machine: {machine_description()}.",
        f"Workload `mixed`: {len(items)} requests, seed {args.seed}, prompts 32-512 tokens (uniform), outputs "
        f"8-512 tokens (log-normal, median {out_lens[len(out_lens) // 2]}, max {out_lens[-1]}), all submitted at "
        f"once, greedy, EOS ignored. max_num_seqs={args.max_num_seqs}, "
        f"max_num_batched_tokens={args.max_num_batched_tokens}, prefix caching off.",
        "",
        markdown_table(["mode", "output tok/s", "req/s", "seconds", "steps", "KV slots holding real tokens",
                        "KV blocks in use", "preemptions"], rows),
        "",
        f"Continuous vs static output throughput: **{speedup:.2f}x**. \"KV slots holding real tokens\" is the mean "
        "over steps of (tokens with computed KV) / (slots in the blocks held): static batching reserves every "
        "request's maximum length up front and keeps finished rows, paged allocation grows a block at a time.",
        "",
        f"Workload `shared-prefix`: {len(prefix_items)} requests sharing a 768-token preamble, 12-32-token "
        "questions, 16 output tokens, continuous batching.",
        "",
        markdown_table(["prefix caching", "seconds", "output tok/s", "prefix hit rate"],
                       [["off", round(off["seconds"], 1), round(off["tokens_per_s"], 1),
                         f"{off['prefix_hit_rate']:.1%}"],
                        ["on", round(on["seconds"], 1), round(on["tokens_per_s"], 1),
                         f"{on['prefix_hit_rate']:.1%}"]]),
        "",
        f"Prefix caching speedup on this workload: **{off['seconds'] / on['seconds']:.2f}x**.",
    ])
    if not args.no_write:
        write_section("batching", body)
        print("wrote docs/BENCHMARKS.md (batching)")


if __name__ == "__main__":
    main()
