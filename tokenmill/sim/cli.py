"""`tokenmill sim run`: a workload through the real scheduler on a simulated clock; same report as
`tokenmill bench serve`."""

from __future__ import annotations

import argparse
import json

from tokenmill.bench.loadgen import arrival_times
from tokenmill.bench.serve_cli import add_workload_args, build_workload, format_summary, results_json
from tokenmill.config import EngineConfig
from tokenmill.model.loader import resolve_model_path
from tokenmill.model.tokenizer import Tokenizer
from tokenmill.sim import specs
from tokenmill.sim.simulator import Simulation


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(specs.MODELS))
    parser.add_argument("--hardware", default="h100-sxm",
                        help=f"one of {sorted(specs.HARDWARE)}, or a profile JSON (tokenmill sim calibrate)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    add_workload_args(parser)
    defaults = EngineConfig()
    g = parser.add_argument_group("scheduler (the engine's own flags)")
    g.add_argument("--block-size", type=int, default=defaults.block_size)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="default: the memory left after the weights")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--max-num-partial-prefills", type=int, default=defaults.max_num_partial_prefills)
    g.add_argument("--max-model-len", type=int, default=8192)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--policy", default=defaults.policy, choices=["fcfs", "priority"])
    g.add_argument("--batching", default=defaults.batching, choices=["continuous", "dynamic", "static"])
    parser.add_argument("--output-json", default=None)


def simulation_from_args(args: argparse.Namespace) -> Simulation:
    config = EngineConfig(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_num_partial_prefills=args.max_num_partial_prefills,
                          enable_prefix_caching=args.enable_prefix_caching, policy=args.policy,
                          batching=args.batching)
    return Simulation(specs.model(args.model), specs.hardware(args.hardware), config, args.tensor_parallel_size,
                      args.max_model_len)


def main(args: argparse.Namespace) -> int:
    simulation = simulation_from_args(args)
    items = build_workload(args, Tokenizer.from_path(resolve_model_path(args.tokenizer)))
    result = simulation.run(items, arrival_times(items, args.request_rate, args.seed), args.slo_ttft, args.slo_tpot)
    print(f"simulated {args.model} on {args.tensor_parallel_size} x {simulation.hw.name}: "
          f"{simulation.num_kv_blocks} KV blocks of {args.block_size} tokens")
    print(format_summary(result.summary))
    print(f"steps {result.num_steps}, preemptions {result.num_preemptions}, peak KV usage "
          f"{result.peak_kv_usage:.0%}; {len(result.results)} requests in {result.wall_seconds:.1f} wall s "
          f"({result.requests_per_wall_second:.0f} simulated requests per wall second)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "func"}, "summary": result.summary,
                       "requests": results_json(result.results)}, f, indent=1, default=str)
    return 0
