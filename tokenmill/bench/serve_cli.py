"""`tokenmill bench serve`: drive an OpenAI-compatible server with a workload and report latency stats."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from tokenmill.bench import workloads
from tokenmill.bench.loadgen import run_load
from tokenmill.bench.stats import RequestResult, summarize
from tokenmill.model.loader import resolve_model_path
from tokenmill.model.tokenizer import Tokenizer


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="model name sent to the server")
    add_workload_args(parser)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--token-prompts", action="store_true", help="send token ids instead of text")
    parser.add_argument("--output-json", default=None)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload and its arrivals (shared with `tokenmill sim`, so both run the same requests)."""
    parser.add_argument("--tokenizer", default=None, help="GGUF file or HF dir for building prompts "
                        "(default: the bundled model)")
    parser.add_argument("--workload", default="mixed", choices=["mixed", "random", "shared-prefix",
                                                                "long-interference", "sharegpt"])
    parser.add_argument("--dataset", default=None, help="ShareGPT-format JSON file (with --workload sharegpt)")
    parser.add_argument("--num-requests", type=int, default=50)
    parser.add_argument("--max-prompt", type=int, default=512, help="mixed: longest prompt (tokens)")
    parser.add_argument("--max-output", type=int, default=512, help="mixed: longest output (tokens)")
    parser.add_argument("--num-prefixes", type=int, default=1,
                        help="shared-prefix: distinct preambles, one drawn at random per request")
    parser.add_argument("--random-input-len", type=int, default=32, help="random: prompt tokens (vLLM's name)")
    parser.add_argument("--random-output-len", type=int, default=256, help="random: output tokens (vLLM's name)")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson rate, req/s (inf: burst)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft", type=float, default=None, help="seconds, for goodput")
    parser.add_argument("--slo-tpot", type=float, default=None, help="seconds, for goodput")


def build_workload(args: argparse.Namespace, tokenizer: Tokenizer) -> list[workloads.WorkItem]:
    if args.workload == "mixed":
        return workloads.mixed(tokenizer, args.num_requests, args.seed, prompt_range=(min(32, args.max_prompt),
                               args.max_prompt), output_range=(min(8, args.max_output), args.max_output))
    if args.workload == "random":
        return workloads.random_lengths(tokenizer, args.num_requests, args.random_input_len, args.random_output_len,
                                        args.seed)
    if args.workload == "shared-prefix":
        return workloads.shared_prefix(tokenizer, args.num_requests, args.seed, num_prefixes=args.num_prefixes)
    if args.workload == "long-interference":
        return workloads.long_interference(tokenizer, args.seed)
    if not args.dataset:
        raise SystemExit("--workload sharegpt needs --dataset FILE")
    return workloads.sharegpt(tokenizer, args.dataset, args.num_requests, args.seed)


def format_summary(summary: dict[str, Any]) -> str:
    lines = [
        f"completed {summary['completed']}, failed {summary['failed']}, duration {summary['duration_s']:.2f} s",
        f"request throughput {summary['request_throughput']:.3f} req/s, output throughput "
        f"{summary['output_throughput']:.2f} tok/s, total {summary['total_token_throughput']:.2f} tok/s",
    ]
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        s = summary[key]
        lines.append(f"{label:>5} ms: mean {s['mean'] * 1000:9.1f}  p50 {s['p50'] * 1000:9.1f}  "
                     f"p90 {s['p90'] * 1000:9.1f}  p99 {s['p99'] * 1000:9.1f}")
    slo = summary["slo"]
    lines.append(f"goodput {summary['goodput']:.3f} req/s ({summary['good_share']:.0%} of requests within "
                 f"TTFT<={slo['ttft_s']} s, TPOT<={slo['tpot_s']} s)")
    return "\n".join(lines)


def results_json(results: list[RequestResult]) -> list[dict[str, Any]]:
    return [{"ok": r.ok, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens, "ttft": r.ttft,
             "tpot": r.tpot, "e2e": r.e2e, "itls": r.itls, "error": r.error} for r in results]


def main(args: argparse.Namespace) -> int:
    tokenizer = Tokenizer.from_path(resolve_model_path(args.tokenizer))
    items = build_workload(args, tokenizer)
    results, duration = asyncio.run(run_load(
        args.base_url, args.model, items, args.request_rate, args.max_concurrency, args.seed, args.api_key,
        args.token_prompts))
    summary = summarize(results, duration, args.slo_ttft, args.slo_tpot)
    print(format_summary(summary))
    errors = [r.error for r in results if r.error]
    if errors:
        print(f"first error: {errors[0]}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "func"}, "summary": summary,
                       "requests": results_json(results)}, f, indent=1, default=str)
    return 0 if not errors else 1
