"""The simulator checked against the real engine on this CPU, then used at GPU scale. Writes the `sim` section of
docs/BENCHMARKS.md.

1. Calibrate (`tokenmill sim calibrate`): time real steps over a grid of plans and the steps of a real workload,
   fit the CPU profile, report the step-time error on held-out plans and steps (target: median within 15%).
2. The `mixed` workload through a real server (`tokenmill bench serve`) and through the simulator with the fitted
   profile and the server's default engine settings, at two request rates: output throughput and TTFT p50
   (target: within 20%).
3. GPU scale: OPT-13B on one A100-80GB, continuous vs dynamic vs static batching on the same burst of requests
   (the shape of Anyscale's continuous-batching results); Llama-3-8B on an H100: a rate sweep with its goodput
   knee (plot), a max_num_batched_tokens sweep, replicas needed for a target rate; a simulated day of requests
   against the wall time it takes to simulate.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from tokenmill.bench import workloads
from tokenmill.bench.loadgen import arrival_times, run_load
from tokenmill.bench.report import machine_description, markdown_table, write_section
from tokenmill.bench.server_process import live_server
from tokenmill.bench.stats import summarize
from tokenmill.config import EngineConfig
from tokenmill.model.loader import load_model
from tokenmill.model.tokenizer import Tokenizer
from tokenmill.router.policy import ROUTERS
from tokenmill.sim import specs
from tokenmill.sim.calibrate import Calibration, calibrate, describe_profile
from tokenmill.sim.cli import SWEEP_HEADER, plot_sweep, sweep_rows
from tokenmill.sim.cost_model import step_seconds
from tokenmill.sim.data_parallel import DataParallelSimulation
from tokenmill.sim.questions import Capacity, capacity, goodput_knee, steady_workload, sweep
from tokenmill.sim.simulator import Simulation
from tokenmill.sim.trace import read_step_trace

ROOT = Path(__file__).resolve().parents[1]
PLOTS = ROOT / "docs" / "plots"


def pct(a: float, b: float) -> str:
    return f"{(a - b) / b:+.0%}"


MODEL = "SmolLM2-135M-Instruct"


def calibrate_and_validate(quantization: str, rates: list[float], num_requests: int, tokenizer: Tokenizer,
                           trace_path: Path) -> tuple[Calibration, list[list[object]]]:
    """One server (OpenMP's default wait policy, as the calibration's own runs) with a step trace: a calibration
    workload through it, the profile fitted to its steps (`tokenmill sim calibrate --step-trace`), then the
    validation rates, each with its own prompts (no run finds another's in the prefix cache)."""
    rows: list[list[object]] = []
    trace_path.unlink(missing_ok=True)
    with live_server("--quantization", quantization, "--disable-log-stats", "--step-trace", str(trace_path),
                     omp_wait_policy=None) as server:
        asyncio.run(run_load(server.url, MODEL, workloads.mixed(tokenizer, 4, seed=100), float("inf"), None, 0))
        time.sleep(0.5)  # the warm-up's lines are written from the server's event loop
        skip = len(trace_path.read_text().splitlines())
        asyncio.run(run_load(server.url, MODEL, workloads.mixed(tokenizer, 60, seed=1), 2.0, None, 1))
        time.sleep(0.5)
        cal = calibrate(quantization, step_trace=read_step_trace(trace_path, skip))
        print(describe_profile(cal.profile))
        print(f"held-out error: grid {cal.grid_error:.1%}, server steps {cal.trace_error:.1%}", flush=True)
        smollm = specs.model("smollm2-135m")
        simulation = Simulation(smollm, cal.profile, EngineConfig(), max_model_len=8192)
        for i, rate in enumerate(rates):
            items = workloads.mixed(tokenizer, num_requests, seed=10 + i)
            before = len(trace_path.read_text().splitlines())
            results, duration = asyncio.run(run_load(server.url, MODEL, items, rate, None, 0))
            time.sleep(0.5)
            real = summarize(results, duration)
            sim = simulation.run(items, arrival_times(items, rate, 0)).summary
            # the same steps the server took, predicted: apart from the scheduling dynamics, how well the profile
            # fits this run (the machine's speed drifts between runs on a shared host)
            served = read_step_trace(trace_path, before)
            steps_ratio = sum(step_seconds(shape, smollm, cal.profile) for shape, _ in served) / sum(
                seconds for _, seconds in served)
            rows.append([rate, round(real["output_throughput"], 1), round(sim["output_throughput"], 1),
                         pct(sim["output_throughput"], real["output_throughput"]),
                         round(real["ttft_s"]["p50"] * 1e3), round(sim["ttft_s"]["p50"] * 1e3),
                         pct(sim["ttft_s"]["p50"], real["ttft_s"]["p50"]),
                         round(real["tpot_s"]["p50"] * 1e3, 1), round(sim["tpot_s"]["p50"] * 1e3, 1),
                         f"{steps_ratio - 1:+.0%}"])
            print(rows[-1], flush=True)
    return cal, rows


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


@dataclass
class GpuQuestions:
    rates: list[list[object]]
    knee: float | None
    budgets: list[list[object]]
    capacity: Capacity
    slo_ttft: float
    slo_tpot: float


def gpu_questions(tokenizer: Tokenizer, duration: float) -> GpuQuestions:
    """Llama-3-8B on one H100-SXM, `mixed`: rate sweep and knee, token-budget sweep at a loaded rate, capacity."""
    slo_ttft, slo_tpot = 1.0, 0.05
    simulation = Simulation(specs.model("llama-3-8b"), specs.hardware("h100-sxm"),
                            EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192))
    workload = steady_workload(lambda n: workloads.mixed(tokenizer, n, seed=3), 200, duration)
    rates = sweep(simulation, workload, "request-rate", [10, 20, 40, 60, 80, 100, 120], 0.0, 3, slo_ttft, slo_tpot,
                  progress=lambda p: print("rate", p.value, flush=True))
    knee = goodput_knee(rates)
    PLOTS.mkdir(exist_ok=True)
    plot_sweep(rates, "request rate (req/s)", str(PLOTS / "sim_rates.png"),
               "simulated: Llama-3-8B on 1 x H100-SXM, mixed")
    budgets = sweep(simulation, workload, "max-num-batched-tokens", [512, 1024, 2048, 4096, 8192], 80.0, 3, slo_ttft,
                    slo_tpot, progress=lambda p: print("budget", p.value, flush=True))
    answer = capacity(simulation, workload, 400.0, slo_ttft, slo_tpot, 0.9, 3)
    return GpuQuestions(sweep_rows(rates), knee.value if knee else None, sweep_rows(budgets), answer, slo_ttft,
                        slo_tpot)


def routing(tokenizer: Tokenizer, profile: specs.HardwareProfile) -> list[list[object]]:
    """Issue 11's workload simulated: 8 long system prompts drawn at random, 2 replicas of this CPU's engine,
    each router, with the default KV pool (every replica can hold all 8) and one holding about half of them."""
    items = workloads.shared_prefix(tokenizer, 400, seed=4, num_prefixes=8)
    arrivals = arrival_times(items, 3.0, 4)
    rows: list[list[object]] = []
    for blocks in (None, 260):
        config = EngineConfig(num_kv_blocks=blocks)
        for router in ROUTERS:
            replica = Simulation(specs.model("smollm2-135m"), profile, config)
            result = DataParallelSimulation(replica, 2, router).run(items, arrivals)
            pool = "default (1 GiB)" if blocks is None else f"{blocks} blocks"
            rows.append([pool, router, f"{result.prefix_hit_rate:.1%}", round(result.summary["ttft_s"]["p50"] * 1e3),
                         round(result.summary["ttft_s"]["p90"] * 1e3), round(result.summary["output_throughput"], 1),
                         "/".join(map(str, result.requests_per_replica))])
            print(rows[-1], flush=True)
    return rows


def routing_section(tokenizer: Tokenizer, profile: specs.HardwareProfile) -> str:
    rows = routing(tokenizer, profile)
    return "\n".join([
        "## Simulated data-parallel routing (`python benchmarks/bench_sim.py --routing-only`)", "",
        "`shared-prefix` with 8 system prompts of 768 tokens drawn at random (`--num-prefixes 8`), 400 "
        "requests at 3 req/s, 16 output tokens, on 2 replicas of this CPU's calibrated engine "
        "(docs/cpu-profile.json, fitted for an engine on both cores: a replica on one core would be slower, "
        "which changes the load, not the routing), simulated with the real router policies "
        "(`tokenmill sim run --data-parallel-size 2 --router ...`):", "",
        markdown_table(["KV pool per replica", "router", "prefix hit rate", "TTFT p50 ms", "TTFT p90 ms",
                        "output tok/s", "requests per replica"], rows), "",
        "With a pool that holds every prompt on every replica, any router keeps the hits once each replica "
        "has seen each prompt; when a replica can hold only about half of them, round-robin and least-load "
        "make both replicas cycle all 8 through their pools, and only prefix-aware routing keeps the hits.",
    ])


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
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 1.5, 2.0])
    parser.add_argument("--num-requests", type=int, default=80)
    parser.add_argument("--gpu-requests", type=int, default=1000)
    parser.add_argument("--day-requests", type=int, default=100_000)
    parser.add_argument("--day-rate", type=float, default=1.2, help="req/s (1.2 req/s is ~100k requests a day)")
    parser.add_argument("--duration", type=float, default=60.0, help="GPU sweeps: seconds of arrivals per point")
    parser.add_argument("--profile", default=str(ROOT / "docs" / "cpu-profile.json"))
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--routing-only", action="store_true",
                        help="only the data-parallel routing simulation (deterministic: any machine state), "
                             "with the saved profile; writes the sim_routing section")
    args = parser.parse_args()
    loaded = load_model(None)
    tokenizer = Tokenizer.from_path(loaded.path, loaded.gguf_reader)
    del loaded
    if args.routing_only:
        routing_body = routing_section(tokenizer, specs.HardwareProfile.load(args.profile))
        if not args.no_write:
            write_section("sim_routing", routing_body)
            print("wrote docs/BENCHMARKS.md (sim_routing)")
        return
    cal, validation = calibrate_and_validate(args.quantization, args.rates, args.num_requests, tokenizer,
                                             Path("/tmp/tokenmill-step-trace.jsonl"))
    cal.profile.save(args.profile)
    batching = gpu_batching(tokenizer, args.gpu_requests)
    questions = gpu_questions(tokenizer, args.duration)
    day = simulated_day(tokenizer, args.day_requests, args.day_rate)
    answer = questions.capacity
    body = "\n".join([
        "## Simulator (`python benchmarks/bench_sim.py`)", "",
        f"Machine: {machine_description()}.", "",
        f"Calibration (`tokenmill sim calibrate --quantization {args.quantization}`, profile in "
        f"docs/cpu-profile.json, `--step-trace` of the server below): {cal.num_grid} synthetic plans (decode "
        "batches 1-64 at contexts 32-1024, prompt chunks 16-512, mixes; the model's time) and the "
        f"{cal.num_trace} steps the server took for 60 `mixed` requests at 2 req/s (each step from its start to "
        "the next one's: the server's threads and the load generator share the 2 cores with the model). A "
        f"quarter of each held out. Fitted: {describe_profile(cal.profile)}.", "",
        f"Median step-time error: **{cal.grid_error:.1%} on held-out grid plans** (model time) and "
        f"**{cal.trace_error:.1%} on held-out server steps** (the whole engine step); "
        f"{cal.fit_error:.1%} on what was fitted.", "",
        markdown_table(["held-out plan", "measured ms", "predicted ms"],
                       [[plan, round(m * 1e3, 2), round(pr * 1e3, 2)] for plan, m, pr in cal.rows]), "",
        f"`mixed` ({args.num_requests} requests, prompts 32-512, outputs 8-512, new prompts at each rate) against "
        f"a real server (`tokenmill serve --quantization {args.quantization}`, default engine settings, OpenMP's "
        "default wait policy as in the calibration) and simulated with the same settings, arrivals and lengths:",
        "",
        markdown_table(["req/s", "real out tok/s", "sim out tok/s", "error", "real TTFT p50 ms", "sim TTFT p50 ms",
                        "error", "real TPOT p50 ms", "sim TPOT p50 ms", "the run's own steps, predicted"],
                       validation), "",
        "The last column predicts the very steps the server took in that run (shapes from its step trace) and "
        "compares their sum with the time they took: it separates the profile's error from the scheduling "
        "dynamics, and shows how much the machine's speed drifted from the calibration run. Near this machine's "
        "knee (about 2 req/s of `mixed`, where prefill alone takes most of the cores) a few percent of speed "
        "moves the queueing, and with it the TTFT, by tens of percent: the simulator is a sizing tool for the "
        "region below the knee and for where the knee lies, not a predictor of queue lengths past it.", "",
        f"GPU scale: OPT-13B (fp16) on one A100-80GB, {args.gpu_requests} requests at once (prompt 512, outputs "
        "16-1536 heavy-tailed, median 128), max_num_batched_tokens 8192:", "",
        markdown_table(["batching", "max_num_seqs", "output tok/s", "vs static", "E2E p50 s", "preemptions"],
                       batching), "",
        "Anyscale measured OPT-13B on one A100-40GB (their blog, 2023): continuous batching (Ray Serve, TGI) "
        "about 8x and vLLM 23x the throughput of Hugging Face pipelines' static batching, and about 4x that of "
        "FasterTransformer's optimized static batching. The simulator runs the same step cost model for every "
        "mode, so its multiples are scheduling alone: 3.4x at the same 16-sequence cap (static batches idle "
        "behind their longest output; dynamic only adds a wait for the batch to fill), 6.1x when the memory "
        "lets 256 sequences run (with preemptions). That is the shape of the kernel-matched comparison "
        "(FasterTransformer, 4x); the 8x-23x also contain slower kernels and memory lost to padding in the "
        "baselines, which this model does not have.", "",
        f"Llama-3-8B (bf16) on one H100-SXM, `mixed`, arrivals spanning at least {args.duration:g} s per point, "
        f"SLOs TTFT <= {questions.slo_ttft:g} s and TPOT <= {questions.slo_tpot * 1e3:g} ms "
        f"(`tokenmill sim sweep --model llama-3-8b --hardware h100-sxm --sweep request-rate ...`). "
        f"Goodput knee (90% of requests within the SLOs): **{questions.knee} req/s**. "
        "Plot: docs/plots/sim_rates.png.", "",
        markdown_table(["req/s offered", *SWEEP_HEADER[1:]], questions.rates), "",
        "The same at 80 req/s, varying max_num_batched_tokens:", "",
        markdown_table(["max_num_batched_tokens", *SWEEP_HEADER[1:]], questions.budgets), "",
        f"Capacity (`tokenmill sim capacity --target-rate 400 ...`): **{answer.replicas} replicas** of Llama-3-8B "
        f"on one H100 each serve 400 req/s of `mixed` with 90% of requests within the SLOs (tried: "
        + ", ".join(f"{n}: {share:.0%}" for n, share in answer.tried)
        + "). Requests are spread evenly (each replica sees a Poisson stream at its share); prefix affinity is "
        "not modelled.", "",
        "A simulated day: Llama-3-8B on one H100-SXM, `mixed` at a steady Poisson rate:", "",
        markdown_table(["requests", "req/s", "simulated hours", "wall s", "simulated requests per wall s",
                        "output tok/s", "TTFT p50 ms", "TPOT p50 ms"], [day]),
    ])
    routing_body = routing_section(tokenizer, cal.profile)
    if not args.no_write:
        write_section("sim", body)
        write_section("sim_routing", routing_body)
        print("wrote docs/BENCHMARKS.md (sim, sim_routing)")


if __name__ == "__main__":
    main()
