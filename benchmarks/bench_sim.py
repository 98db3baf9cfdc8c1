"""The simulator checked against the real engine on this CPU, then used at GPU scale. Writes the `sim` section of
docs/BENCHMARKS.md.

1. Calibrate (`tokenmill sim calibrate`): time real steps over a grid of plans, fit the CPU profile, report the
   step-time error on held-out plans (target: median within 15%).
2. The `mixed` workload through a real server (`tokenmill bench serve`) and through the simulator with the fitted
   profile and the server's default engine settings, at two request rates: output throughput and TTFT p50
   (target: within 20%).
3. GPU scale: OPT-13B on one A100-80GB, continuous vs dynamic vs static batching on the same burst of requests
   (the shape of Anyscale's continuous-batching results), and a simulated day of requests against the wall
   time it takes to simulate.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from tokenmill.bench import workloads
from tokenmill.bench.loadgen import arrival_times, run_load
from tokenmill.bench.report import machine_description, markdown_table, write_section
from tokenmill.bench.server_process import live_server
from tokenmill.bench.stats import summarize
from tokenmill.config import EngineConfig
from tokenmill.model.loader import load_model
from tokenmill.model.tokenizer import Tokenizer
from tokenmill.sim import specs
from tokenmill.sim.calibrate import calibrate
from tokenmill.sim.simulator import Simulation

ROOT = Path(__file__).resolve().parents[1]


def pct(a: float, b: float) -> str:
    return f"{(a - b) / b:+.0%}"


def validate_cpu(profile: specs.HardwareProfile, quantization: str, rates: list[float], num_requests: int,
                 tokenizer: Tokenizer) -> list[list[object]]:
    items = workloads.mixed(tokenizer, num_requests, seed=0)
    rows: list[list[object]] = []
    simulation = Simulation(specs.model("smollm2-135m"), profile, EngineConfig(), max_model_len=8192)
    with live_server("--quantization", quantization, "--disable-log-stats") as server:
        asyncio.run(run_load(server.url, "SmolLM2-135M-Instruct", items[:4], float("inf"), None, 0))  # warm-up
        for rate in rates:
            results, duration = asyncio.run(run_load(server.url, "SmolLM2-135M-Instruct", items, rate, None, 0))
            real = summarize(results, duration)
            sim = simulation.run(items, arrival_times(items, rate, 0)).summary
            rows.append([rate, round(real["output_throughput"], 1), round(sim["output_throughput"], 1),
                         pct(sim["output_throughput"], real["output_throughput"]),
                         round(real["ttft_s"]["p50"] * 1e3), round(sim["ttft_s"]["p50"] * 1e3),
                         pct(sim["ttft_s"]["p50"], real["ttft_s"]["p50"]),
                         round(real["tpot_s"]["p50"] * 1e3, 1), round(sim["tpot_s"]["p50"] * 1e3, 1)])
            print(rows[-1], flush=True)
    return rows


def gpu_batching(tokenizer: Tokenizer, num_requests: int) -> list[list[object]]:
    items = workloads.mixed(tokenizer, num_requests, seed=1, prompt_range=(512, 512), output_range=(16, 1536),
                            output_median=128.0)
    arrivals = arrival_times(items, float("inf"), 0)
    rows: list[list[object]] = []
    base = None
    for mode, seqs in (("static", 16), ("dynamic", 16), ("continuous", 16), ("continuous", 256)):
        config = EngineConfig(batching=mode, max_num_seqs=seqs, max_num_batched_tokens=8192)
        result = Simulation(specs.model("opt-13b"), specs.hardware("a100-80gb"), config, max_model_len=2048).run(
            items, arrivals)
        throughput = result.summary["output_throughput"]
        base = base or throughput
        rows.append([mode, seqs, round(throughput), f"{throughput / base:.1f}x",
                     round(result.summary["e2e_s"]["p50"], 1), result.num_preemptions])
        print(rows[-1], flush=True)
    return rows


def simulated_day(tokenizer: Tokenizer, num_requests: int, rate: float) -> list[object]:
    items = workloads.mixed(tokenizer, num_requests, seed=2)
    start = time.perf_counter()
    result = Simulation(specs.model("llama-3-8b"), specs.hardware("h100-sxm"),
                        EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192)).run(
        items, arrival_times(items, rate, 2))
    wall = time.perf_counter() - start
    summary = result.summary
    row = [num_requests, rate, round(summary["duration_s"] / 3600, 2), round(wall, 1),
           round(num_requests / wall), round(summary["output_throughput"]), round(summary["ttft_s"]["p50"] * 1e3),
           round(summary["tpot_s"]["p50"] * 1e3, 1)]
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--rates", type=float, nargs="+", default=[1.5, 3.0])
    parser.add_argument("--num-requests", type=int, default=80)
    parser.add_argument("--gpu-requests", type=int, default=1000)
    parser.add_argument("--day-requests", type=int, default=100_000)
    parser.add_argument("--day-rate", type=float, default=1.2, help="req/s (1.2 req/s is ~100k requests a day)")
    parser.add_argument("--profile", default=str(ROOT / "docs" / "cpu-profile.json"))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    loaded = load_model(None)
    tokenizer = Tokenizer.from_path(loaded.path, loaded.gguf_reader)
    del loaded
    cal = calibrate(args.quantization)
    cal.profile.save(args.profile)
    p = cal.profile
    print(f"held-out step error {cal.held_out_error:.1%}", flush=True)
    validation = validate_cpu(p, args.quantization, args.rates, args.num_requests, tokenizer)
    batching = gpu_batching(tokenizer, args.gpu_requests)
    day = simulated_day(tokenizer, args.day_requests, args.day_rate)
    body = "\n".join([
        "## Simulator (`python benchmarks/bench_sim.py`)", "",
        f"Machine: {machine_description()}.", "",
        f"Calibration (`tokenmill sim calibrate --quantization {args.quantization}`, profile in "
        f"docs/cpu-profile.json): {len(cal.rows) * 4} plans timed, a quarter held out. Fitted: "
        f"{p.step_overhead_s * 1e3:.2f} ms per step + {p.per_sequence_s * 1e6:.0f} us per sequence, compute at "
        f"{p.flops_efficiency:.2f} of {p.peak_flops / 1e9:.0f} GOP/s (measured GEMM), memory at "
        f"{p.bandwidth_efficiency:.2f} of {p.memory_bandwidth / 1e9:.1f} GB/s (measured copy). Median step-time "
        f"error: **{cal.held_out_error:.1%} on held-out plans** ({cal.fit_error:.1%} on the fitted ones).", "",
        markdown_table(["held-out plan", "measured ms", "predicted ms"],
                       [[plan, round(m * 1e3, 2), round(pr * 1e3, 2)] for plan, m, pr in cal.rows]), "",
        f"`mixed` ({args.num_requests} requests, prompts 32-512, outputs 8-512) against a real server "
        f"(`tokenmill serve --quantization {args.quantization}`, default engine settings) and simulated with the "
        "same settings, arrivals and lengths:", "",
        markdown_table(["req/s", "real out tok/s", "sim out tok/s", "error", "real TTFT p50 ms", "sim TTFT p50 ms",
                        "error", "real TPOT p50 ms", "sim TPOT p50 ms"], validation), "",
        f"GPU scale: OPT-13B (fp16) on one A100-80GB, {args.gpu_requests} requests at once (prompt 512, outputs "
        "16-1536 heavy-tailed, median 128), max_num_batched_tokens 8192:", "",
        markdown_table(["batching", "max_num_seqs", "output tok/s", "vs static", "E2E p50 s", "preemptions"],
                       batching), "",
        "A simulated day: Llama-3-8B on one H100-SXM, `mixed` at a steady Poisson rate:", "",
        markdown_table(["requests", "req/s", "simulated hours", "wall s", "simulated requests per wall s",
                        "output tok/s", "TTFT p50 ms", "TPOT p50 ms"], [day]),
    ])
    if not args.no_write:
        write_section("sim", body)
        print("wrote docs/BENCHMARKS.md (sim)")


if __name__ == "__main__":
    main()
