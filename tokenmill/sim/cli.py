"""`tokenmill sim run | sweep | capacity`: a workload through the real scheduler on a simulated clock, with the
report of `tokenmill bench serve`; a sweep of one setting (with the goodput knee of a rate sweep, and a plot);
the replicas needed for a target rate under SLOs."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tokenmill.bench.loadgen import arrival_times
from tokenmill.bench.report import markdown_table
from tokenmill.bench.serve_cli import add_workload_args, build_workload, format_summary, results_json
from tokenmill.bench.stats import RequestResult
from tokenmill.bench.workloads import WorkItem
from tokenmill.config import EngineConfig
from tokenmill.model.loader import resolve_model_path
from tokenmill.model.tokenizer import Tokenizer
from tokenmill.router.policy import ROUTERS
from tokenmill.sim import specs
from tokenmill.sim.data_parallel import DataParallelSimulation
from tokenmill.sim.questions import SWEEPABLE, SweepPoint, Workload, capacity, goodput_knee, steady_workload, sweep
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
    g.add_argument("--target-itl-ms", type=float, default=None,
                   help="the engine's self-setting prompt budget (as `tokenmill serve --target-itl-ms`)")
    g.add_argument("--max-model-len", type=int, default=8192)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--policy", default=defaults.policy, choices=["fcfs", "priority"])
    g.add_argument("--batching", default=defaults.batching, choices=["continuous", "dynamic", "static"])
    g.add_argument("--data-parallel-size", type=int, default=1, help="replicas, each with its own KV pool")
    g.add_argument("--router", default="prefix-aware", choices=ROUTERS, help="with --data-parallel-size > 1")
    parser.add_argument("--output-json", default=None)


def simulation_from_args(args: argparse.Namespace) -> Simulation:
    config = EngineConfig(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_num_partial_prefills=args.max_num_partial_prefills,
                          enable_prefix_caching=args.enable_prefix_caching, policy=args.policy,
                          batching=args.batching, target_itl_ms=args.target_itl_ms)
    return Simulation(specs.model(args.model), specs.hardware(args.hardware), config, args.tensor_parallel_size,
                      args.max_model_len)


def main(args: argparse.Namespace) -> int:
    items = build_workload(args, Tokenizer.from_path(resolve_model_path(args.tokenizer)))
    if args.data_parallel_size > 1:
        return data_parallel_main(args, items)
    simulation = simulation_from_args(args)
    result = simulation.run(items, arrival_times(items, args.request_rate, args.seed), args.slo_ttft, args.slo_tpot)
    print(f"simulated {args.model} on {args.tensor_parallel_size} x {simulation.hw.name}: "
          f"{simulation.num_kv_blocks} KV blocks of {args.block_size} tokens")
    print(format_summary(result.summary))
    print(f"steps {result.num_steps}, preemptions {result.num_preemptions}, peak KV usage "
          f"{result.peak_kv_usage:.0%}; {len(result.results)} requests in {result.wall_seconds:.1f} wall s "
          f"({result.requests_per_wall_second:.0f} simulated requests per wall second)")
    write_json(args, result.summary, result.results)
    return 0


def write_json(args: argparse.Namespace, summary: dict[str, Any], results: list[RequestResult]) -> None:
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "func"}, "summary": summary,
                       "requests": results_json(results)}, f, indent=1, default=str)


def data_parallel_main(args: argparse.Namespace, items: list[WorkItem]) -> int:
    replica = simulation_from_args(args)
    simulation = DataParallelSimulation(replica, args.data_parallel_size, args.router)
    result = simulation.run(items, arrival_times(items, args.request_rate, args.seed), args.slo_ttft, args.slo_tpot)
    print(f"simulated {args.data_parallel_size} x {args.model} on {args.tensor_parallel_size} x {replica.hw.name} "
          f"each, router {args.router}: {replica.num_kv_blocks} KV blocks of {args.block_size} tokens each")
    print(format_summary(result.summary))
    print(f"prefix cache hit rate {result.prefix_hit_rate:.1%}; requests per replica {result.requests_per_replica}; "
          f"router decisions {dict(result.decisions)}; {len(result.results)} requests in "
          f"{result.wall_seconds:.1f} wall s")
    write_json(args, result.summary, result.results)
    return 0


def add_steady_args(parser: argparse.ArgumentParser) -> None:
    add_args(parser)
    parser.add_argument("--duration", type=float, default=60.0,
                        help="arrivals span at least this many seconds (more requests than --num-requests when "
                             "the rate needs them: a short run under overload hides the growing queue)")


def workload_from_args(args: argparse.Namespace) -> Workload:
    tokenizer = Tokenizer.from_path(resolve_model_path(args.tokenizer))
    return steady_workload(lambda n: build_workload(argparse.Namespace(**{**vars(args), "num_requests": n}),
                                                    tokenizer), args.num_requests, args.duration)


def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    add_steady_args(parser)
    parser.add_argument("--sweep", required=True, choices=sorted(SWEEPABLE), help="the setting to vary")
    parser.add_argument("--values", required=True, nargs="+", help="its values (batching: static dynamic continuous)")
    parser.add_argument("--attainment", type=float, default=0.9,
                        help="share of requests within the SLOs that counts as meeting them (the knee)")
    parser.add_argument("--plot", default=None, help="write a PNG of throughput, goodput and latencies")


def sweep_rows(points: list[SweepPoint]) -> list[list[object]]:
    rows: list[list[object]] = []
    for p in points:
        s = p.summary
        rows.append([p.value, round(s["output_throughput"], 1), round(s["request_throughput"], 2),
                     round(s["goodput"], 2), f"{s['good_share']:.0%}", round(s["ttft_s"]["p50"] * 1e3),
                     round(s["ttft_s"]["p90"] * 1e3), round(s["tpot_s"]["p50"] * 1e3, 1),
                     round(s["tpot_s"]["p90"] * 1e3, 1), p.result.num_preemptions, f"{p.result.peak_kv_usage:.0%}"])
    return rows


SWEEP_HEADER = ["", "out tok/s", "req/s", "goodput req/s", "within SLOs", "TTFT p50 ms", "TTFT p90 ms",
                "TPOT p50 ms", "TPOT p90 ms", "preemptions", "peak KV"]


def plot_sweep(points: list[SweepPoint], parameter: str, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(p.value) for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot(labels, [p.summary["request_throughput"] for p in points], marker="o", label="completed")
    axes[0].plot(labels, [p.summary["goodput"] for p in points], marker="o", label="goodput (within SLOs)")
    axes[0].set_title("requests/s")
    axes[0].legend()
    for ax, key, name in ((axes[1], "ttft_s", "TTFT"), (axes[2], "tpot_s", "TPOT")):
        for q in ("p50", "p90"):
            ax.plot(labels, [p.summary[key][q] * 1e3 for p in points], marker="o", label=q)
        ax.set_title(f"{name} (ms)")
        ax.set_yscale("log")
        ax.legend()
    for ax in axes:
        ax.set_xlabel(parameter)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep_main(args: argparse.Namespace) -> int:
    simulation = simulation_from_args(args)
    points = sweep(simulation, workload_from_args(args), args.sweep, args.values, args.request_rate, args.seed,
                   args.slo_ttft, args.slo_tpot,
                   progress=lambda p: print(f"  {args.sweep} {p.value}: done", flush=True))
    title = f"{args.model} on {args.tensor_parallel_size} x {simulation.hw.name}, {args.workload}"
    print(title)
    print(markdown_table([args.sweep, *SWEEP_HEADER[1:]], sweep_rows(points)))
    if args.sweep == "request-rate" and (args.slo_ttft or args.slo_tpot):
        knee = goodput_knee(points, args.attainment)
        print(f"goodput knee: {knee.value} req/s" if knee else "goodput knee: below the lowest rate swept")
    if args.plot:
        plot_sweep(points, args.sweep, args.plot, title)
        print(f"wrote {args.plot}")
    return 0


def add_capacity_args(parser: argparse.ArgumentParser) -> None:
    add_steady_args(parser)
    parser.add_argument("--target-rate", type=float, required=True, help="req/s the fleet must serve")
    parser.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet the SLOs")
    parser.add_argument("--max-replicas", type=int, default=1024)


def capacity_main(args: argparse.Namespace) -> int:
    simulation = simulation_from_args(args)
    answer = capacity(simulation, workload_from_args(args), args.target_rate, args.slo_ttft, args.slo_tpot,
                      args.attainment, args.seed, args.max_replicas)
    print(f"{args.model} on {args.tensor_parallel_size} x {simulation.hw.name} per replica, {args.workload} at "
          f"{args.target_rate} req/s, SLOs TTFT<={args.slo_ttft} s, TPOT<={args.slo_tpot} s for "
          f"{args.attainment:.0%} of requests")
    for replicas, share in answer.tried:
        print(f"  {replicas} replicas: {share:.0%} within the SLOs")
    if answer.replicas is None:
        print(f"not met with {args.max_replicas} replicas")
        return 1
    assert answer.result is not None
    print(f"replicas needed: {answer.replicas} ({answer.per_replica_rate:.2f} req/s each)")
    print(format_summary(answer.result.summary))
    return 0
