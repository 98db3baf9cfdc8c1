"""`tokenmill bench sweep`: the serving experiments end to end on this machine (the claim continuous batching
makes, measured against static and dynamic batching at their best), written as a section of BENCHMARKS.md with
its plots and the raw numbers (JSON).

Phases: the single stream (the SLOs' base), each mode's capacity in a closed loop (the baselines at each batch
size), Poisson rates around each mode's capacity, the simulator's prediction of the same, chunked prefill under a
long prompt, prefix caching, KV memory held versus used."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import tokenmill
from tokenmill.bench import sweep_scenarios as scenarios
from tokenmill.bench import workloads
from tokenmill.bench.report import machine_description, write_section
from tokenmill.bench.server_process import live_server
from tokenmill.bench.sweep_load import (
    Capacity,
    RatePoint,
    ServerFacts,
    capacity_requests,
    knee_rate,
    measure_capacity,
    measure_rate,
    points_requests,
    server_facts,
    single_stream,
    warm_up,
)
from tokenmill.bench.sweep_report import MODES, SweepData, report_body, write_plots
from tokenmill.bench.workloads import WorkItem
from tokenmill.config import EngineConfig
from tokenmill.model.loader import resolve_model_path
from tokenmill.model.tokenizer import Tokenizer

TIME_TARGET_MIN = 20.0  # the bundled model's whole sweep


def default_output_dir() -> Path:
    """docs/ of the clone this package runs from; otherwise ./tokenmill-sweep (never beside site-packages)."""
    root = Path(tokenmill.__file__).resolve().parents[1]
    return root / "docs" if (root / ".git").exists() and (root / "docs").is_dir() else Path.cwd() / "tokenmill-sweep"


def provenance() -> str:
    root = Path(tokenmill.__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        commit += " (with uncommitted changes)" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = f"tokenmill {getattr(tokenmill, '__version__', 'installed')} (not a clone)"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"Measured {date} on {machine_description()}; commit {commit}; command "
            f"`tokenmill {shlex.join(sys.argv[1:])}`")


class Phases:
    """A progress line per phase: what it is, about how long it takes, and when the whole sweep should end."""

    def __init__(self, estimates: dict[str, float]) -> None:
        self.estimates = estimates
        self.start = time.monotonic()
        self.done: list[str] = []

    def begin(self, name: str, estimate: float | None = None) -> None:
        if estimate is not None:
            self.estimates[name] = estimate
        remaining = sum(s for n, s in self.estimates.items() if n not in self.done)
        index = list(self.estimates).index(name) + 1
        print(f"[{index}/{len(self.estimates)}] {name}: about {self.estimates[name]:.0f} s; elapsed "
              f"{time.monotonic() - self.start:.0f} s, sweep ETA about {remaining:.0f} s", flush=True)
        self.done.append(name)


def add_args(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--model", default=None, help="GGUF file or HF directory to serve (default: the bundled SmolLM2-135M)")
    a("--output", default=None, metavar="DIR",
      help="where BENCHMARKS.md (its section), plots/ and the raw JSON go (default: docs/ when run from a clone, "
           "else ./tokenmill-sweep)")
    a("--batch-sizes", type=int, nargs="+", default=[8, 16, 32],
      help="max_num_seqs values static and dynamic batching run at; each keeps its best")
    a("--rate-multiples", type=float, nargs="+", default=[0.25, 0.5, 1.0, 1.5],
      help="Poisson rates swept, as multiples of each mode's measured capacity")
    a("--requests-per-point", type=int, default=100, help="requests at each rate (fewer under --point-seconds)")
    a("--point-seconds", type=float, default=25.0,
      help="cap on a rate point's arrivals: a low rate sends rate x this many requests if under "
           "--requests-per-point")
    a("--min-requests", type=int, default=20, help="floor on a rate point's requests")
    a("--prompt-range", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"),
      help="prompt tokens, uniform (outputs longer than prompts on average, as in chat datasets)")
    a("--output-range", type=int, nargs=2, default=[8, 512], metavar=("MIN", "MAX"),
      help="output tokens, log-normal (sigma 1) clipped to this range")
    a("--output-median", type=float, default=96.0, help="median of the output tokens")
    a("--slo-ttft", type=float, default=None, help="TTFT SLO in s (default: --slo-ttft-multiple x single stream)")
    a("--slo-tpot", type=float, default=None, help="TPOT SLO in s (default: --slo-tpot-multiple x single stream)")
    a("--slo-ttft-multiple", type=float, default=3.0, help="the TTFT SLO as a multiple of the single stream's")
    a("--slo-tpot-multiple", type=float, default=2.0, help="the TPOT SLO as a multiple of the single stream's")
    a("--attainment", type=float, default=0.9, help="share of requests within the SLOs that counts as meeting them")
    a("--long-prefill-seconds", type=float, default=2.0,
      help="the interference run's long prompt is sized to take at least this long to prefill alone")
    a("--prefix-requests", type=int, default=20, help="requests of the shared-prefix run")
    a("--prefix-rate", type=float, default=None,
      help="their Poisson rate in req/s (default: half the rate the server prefills them at without caching, "
           "from the measured prefill speed: queueing must not make the uncached side slower than its prefill)")
    a("--prefix-len", type=int, default=1024, help="tokens of the preamble they share")
    a("--kv-requests", type=int, default=24, help="requests of the offline KV memory run")
    a("--no-sim", dest="sim", action="store_false", help="skip the simulator's prediction")
    a("--sim-repeats", type=int, default=3, help="timings per plan when calibrating the simulator")
    a("--skip", nargs="+", default=[], choices=["interference", "prefix", "kv"], help="parts to leave out")
    a("--seed", type=int, default=0, help="seed of every workload and arrival process")


@dataclasses.dataclass
class Sweep:
    args: argparse.Namespace
    tokenizer: Tokenizer
    model_name: str
    trace_path: str

    def items(self, n: int, seed: int) -> list[WorkItem]:
        a = self.args
        return workloads.mixed(self.tokenizer, n, seed, prompt_range=tuple(a.prompt_range),
                               output_range=tuple(a.output_range), output_median=a.output_median)

    @contextmanager
    def server(self, *flags: str) -> Iterator[ServerFacts]:
        model = ["--model", self.args.model] if self.args.model else []
        with live_server(*model, *flags) as srv:
            yield server_facts(srv.url)

    def mode_flags(self, mode: str, max_num_seqs: int) -> list[str]:
        if mode == "continuous":  # the engine's defaults; its steps calibrate the simulator
            return ["--no-prefix-caching", "--step-trace", self.trace_path]
        return ["--batching", mode, "--max-num-seqs", str(max_num_seqs), "--no-prefix-caching"]


def main(args: argparse.Namespace) -> int:
    start = time.monotonic()
    out_dir = Path(args.output) if args.output else default_output_dir()
    tokenizer = Tokenizer.from_path(resolve_model_path(args.model))
    model_name = Path(args.model).name if args.model else "SmolLM2-135M-Instruct (bundled)"
    defaults = EngineConfig()
    runs = 1 + 2 * len(args.batch_sizes)
    phases = Phases({"single stream": 20, "capacity": 60.0 * runs, "rates": 3 * 40.0 * len(args.rate_multiples),
                     "simulator": 60 if args.sim else 0,
                     "interference": 0 if "interference" in args.skip else 60,
                     "prefix caching": 0 if "prefix" in args.skip else 10 + 2 * args.prefix_requests,
                     "KV memory": 0 if "kv" in args.skip else 30})
    with tempfile.TemporaryDirectory() as tmp:
        sweep = Sweep(args, tokenizer, model_name, str(Path(tmp) / "steps.jsonl"))
        data, point_items, facts = measure(sweep, phases, defaults)
        if args.sim:
            phases.begin("simulator")
            predict(sweep, data, point_items, facts, defaults)
    scenario_parts(sweep, data, phases, facts.max_model_len)
    data.elapsed_s = time.monotonic() - start
    write(args, data, out_dir)
    print(f"wrote {out_dir / 'BENCHMARKS.md'} and {out_dir / 'plots'}/ in {data.elapsed_s / 60:.1f} min")
    return 0


def measure(sweep: Sweep, phases: Phases, defaults: EngineConfig,
            ) -> tuple[SweepData, dict[str, list[list[WorkItem]]], ServerFacts]:
    """The single stream, capacities and rate points; with the requests of each point and the server's facts
    (the simulator replays both)."""
    args = sweep.args
    phases.begin("single stream")
    with sweep.server(*sweep.mode_flags("continuous", defaults.max_num_seqs)) as server:
        warm_up(server, sweep.tokenizer)
        single = single_stream(server, sweep.tokenizer, sweep.items(8, args.seed + 1000))
        facts = server
    slo_ttft = args.slo_ttft or args.slo_ttft_multiple * single.ttft_s
    slo_tpot = args.slo_tpot or args.slo_tpot_multiple * single.tpot_s
    slo_source = ("given" if args.slo_ttft and args.slo_tpot else
                  f"{args.slo_ttft_multiple:g}x and {args.slo_tpot_multiple:g}x the single stream's, unless given")
    print(f"  single stream: TTFT {single.ttft_s * 1e3:.0f} ms, TPOT {single.tpot_s * 1e3:.1f} ms, prefill "
          f"{single.prefill_tokens_per_s:.0f} tok/s; SLOs TTFT <= {slo_ttft:.3f} s, TPOT <= {slo_tpot * 1e3:.1f} ms",
          flush=True)

    phases.begin("capacity")
    capacities: list[Capacity] = []
    sizes = {"continuous": [defaults.max_num_seqs], "static": args.batch_sizes, "dynamic": args.batch_sizes}
    for mode in MODES:
        for size in sizes[mode]:
            items = sweep.items(capacity_requests(mode, size), args.seed)
            with sweep.server(*sweep.mode_flags(mode, size)) as server:
                warm_up(server, sweep.tokenizer)
                capacities.append(measure_capacity(server, mode, size, items))
            c = capacities[-1]
            print(f"  {mode:>10} max_num_seqs {size:>3}: {c.output_tokens_per_s:6.1f} tok/s ({c.requests_per_s:.2f} "
                  f"req/s), {c.mean_running:.1f} running, KV {c.mean_kv_usage:.0%}", flush=True)
    best: dict[str, Capacity] = {
        mode: max((c for c in capacities if c.mode == mode), key=lambda c: c.output_tokens_per_s) for mode in MODES}

    plan = {mode: [(i, m, m * best[mode].requests_per_s) for i, m in enumerate(args.rate_multiples)] for mode in MODES}
    sizes_of = {mode: [points_requests(rate, args.requests_per_point, args.point_seconds, args.min_requests)
                       for _, _, rate in plan[mode]] for mode in MODES}
    estimate = sum(n / rate + 5 for mode in MODES for (_, _, rate), n in zip(plan[mode], sizes_of[mode]))
    phases.begin("rates", estimate)
    points: dict[str, list[RatePoint]] = {}
    point_items: dict[str, list[list[WorkItem]]] = {}
    for mode in MODES:
        points[mode], point_items[mode] = [], []
        with sweep.server(*sweep.mode_flags(mode, best[mode].max_num_seqs)) as server:
            warm_up(server, sweep.tokenizer)
            for (i, multiple, rate), n in zip(plan[mode], sizes_of[mode]):
                items = sweep.items(n, args.seed + i)
                point = measure_rate(server, items, multiple, rate, args.seed + i, slo_ttft, slo_tpot)
                points[mode].append(point)
                point_items[mode].append(items)
                s = point.summary
                print(f"  {mode:>10} {multiple:>4g}x = {rate:5.2f} req/s, {n} requests ({point.num_cut} cut): "
                      f"{point.streamed_output_tokens_per_s:6.1f} tok/s, TTFT p90 {s['ttft_s']['p90']:.2f} s, TPOT "
                      f"p90 {s['tpot_s']['p90'] * 1e3:.0f} ms, {s['good_share']:.0%} within SLOs", flush=True)
    static_check(sweep, args, best["static"], points, point_items, slo_ttft, slo_tpot)
    a = args
    workload = (f"`mixed`: prompts {a.prompt_range[0]}-{a.prompt_range[1]} tokens (uniform), outputs "
                f"{a.output_range[0]}-{a.output_range[1]} (log-normal, median {a.output_median:g}), seed {a.seed}")
    data = SweepData(sweep.model_name, provenance(), workload, single, slo_ttft, slo_tpot, slo_source,
                     args.attainment, capacities, best, points)
    return data, point_items, facts


def static_check(sweep: Sweep, args: argparse.Namespace, static: Capacity, points: dict[str, list[RatePoint]],
                 point_items: dict[str, list[list[WorkItem]]], slo_ttft: float, slo_tpot: float) -> None:
    """Where static batching met the SLOs at none of its rates, one more point decides the knee target: static at
    a third of continuous batching's knee. Missing the SLOs there puts static's knee below it."""
    knee = knee_rate(points["continuous"], args.attainment)
    if knee is None or knee_rate(points["static"], args.attainment) is not None:
        return
    rate = knee / 3
    if min(p.rate for p in points["static"]) <= rate:
        return
    index = len(points["static"])
    n = points_requests(rate, args.requests_per_point, args.point_seconds, args.min_requests)
    items = sweep.items(n, args.seed + index)
    print(f"  static at a third of continuous batching's knee ({rate:.2f} req/s), {n} requests", flush=True)
    with sweep.server(*sweep.mode_flags("static", static.max_num_seqs)) as server:
        warm_up(server, sweep.tokenizer)
        point = measure_rate(server, items, rate / static.requests_per_s, rate, args.seed + index, slo_ttft, slo_tpot)
    print(f"    {point.summary['good_share']:.0%} within SLOs", flush=True)
    points["static"].append(point)
    point_items["static"].append(items)


def predict(sweep: Sweep, data: SweepData, point_items: dict[str, list[list[WorkItem]]], facts: ServerFacts,
            defaults: EngineConfig) -> None:
    from tokenmill.bench.sweep_sim import calibrated, saturated_rate, simulate_points, simulation
    from tokenmill.sim.calibrate import describe_profile

    args = sweep.args
    calibration = calibrated(args.model, sweep.trace_path, args.sim_repeats)
    data.calibration_note = (
        f"The simulator (`tokenmill sim`) was calibrated in this run on {calibration.num_grid} timed plans and "
        f"the continuous server's {calibration.num_trace} steps ({describe_profile(calibration.profile)}; median "
        f"error on held-out steps {calibration.trace_error:.0%}) and replays the same requests and arrivals.")
    blocks = facts.kv_capacity_tokens // defaults.block_size
    for mode in MODES:
        size = data.best[mode].max_num_seqs
        sim = simulation(calibration, mode, size, facts.max_model_len, blocks)
        items = sweep.items(capacity_requests(mode, size), args.seed)
        data.simulated_capacity[mode] = saturated_rate(sim, items)
        data.simulated_points[mode] = simulate_points(sim, point_items[mode], data.points[mode], args.seed,
                                                      data.slo_ttft, data.slo_tpot)
        print(f"  simulated {mode:>10}: {data.simulated_capacity[mode]:6.1f} tok/s at saturation", flush=True)


def scenario_parts(sweep: Sweep, data: SweepData, phases: Phases, max_model_len: int) -> None:
    args = sweep.args
    if "interference" not in args.skip:
        plan = scenarios.plan_interference(data.single, max_model_len, args.long_prefill_seconds)
        phases.begin("interference", 3 * (plan.arrival_s + 3 * plan.estimated_prefill_s + 8))
        data.interference_plan = plan
        data.interference = scenarios.interference(sweep.server, sweep.tokenizer, plan, args.seed)
        for name, run in data.interference.items():
            print(f"  {name:>22}: worst gap {run.worst_gap:.3f} s, long TTFT {run.long_ttft:.2f} s"
                  + (f" (invalid: {run.problem})" if run.problem else ""), flush=True)
    if "prefix" not in args.skip:
        rate = args.prefix_rate or 0.5 * data.single.prefill_tokens_per_s / (args.prefix_len + 22)
        phases.begin("prefix caching", 10 + 2 * args.prefix_requests / rate)
        data.prefix = scenarios.prefix_caching(sweep.server, sweep.tokenizer, args.prefix_requests, rate,
                                               args.prefix_len, args.seed)
        data.prefix_note = (f"{args.prefix_requests} requests sharing a {args.prefix_len}-token preamble, "
                            f"12-32 own tokens each, 16 out, Poisson {rate:.2f} req/s")
        for name, prefix_run in data.prefix.items():
            print(f"  prefix caching {name}: TTFT mean {prefix_run.summary['ttft_s']['mean'] * 1e3:.0f} ms, hit "
                  f"rate {prefix_run.hit_rate:.0%}", flush=True)
    if "kv" not in args.skip:
        phases.begin("KV memory")
        data.kv = scenarios.kv_memory(args.model, sweep.tokenizer, sweep.items(args.kv_requests, args.seed),
                                      {mode: data.best[mode].max_num_seqs for mode in MODES})


def write(args: argparse.Namespace, data: SweepData, out_dir: Path) -> None:
    slug = "" if args.model is None else Path(args.model).stem.lower().replace(".", "-") + "-"
    plots = write_plots(data, out_dir / "plots", slug)
    title = data.model
    body = report_body(data, plots, title, TIME_TARGET_MIN if args.model is None else None)
    write_section("serving" if args.model is None else f"serving-{slug.rstrip('-')}", body,
                  out_dir / "BENCHMARKS.md")
    raw = {"model": data.model, "provenance": data.provenance, "single": dataclasses.asdict(data.single),
           "slo": {"ttft_s": data.slo_ttft, "tpot_s": data.slo_tpot},
           "capacities": [dataclasses.asdict(c) for c in data.capacities],
           "points": {m: [_point_json(p) for p in ps] for m, ps in data.points.items()},
           "simulated_capacity": data.simulated_capacity,
           "simulated_points": {m: [_point_json(p) for p in ps] for m, ps in data.simulated_points.items()},
           "interference": {n: {k: v for k, v in dataclasses.asdict(r).items() if k != "timeline"}
                            for n, r in data.interference.items()},
           "prefix": {n: {"summary": r.summary, "hit_rate": r.hit_rate} for n, r in data.prefix.items()},
           "kv": data.kv, "elapsed_s": data.elapsed_s}
    (out_dir / f"sweep-{slug or 'bundled-'}results.json").write_text(json.dumps(raw, indent=1, default=str) + "\n")


def _point_json(p: RatePoint) -> dict[str, object]:
    return {"multiple": p.multiple, "rate": p.rate, "requests": p.num_requests, "cut": p.num_cut,
            "streamed_output_tokens_per_s": p.streamed_output_tokens_per_s, "summary": p.summary}
