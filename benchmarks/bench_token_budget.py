"""The self-setting token budget (`--target-itl-ms`) against fixed budgets, side by side in one run on this
machine (bundled model), and the same comparison in `tokenmill sim` for Llama-3-8B on an H100:

1. `long-interference`: 8 short streams decoding when a 3,000-token prompt arrives 1 s later: the short streams'
   worst and median inter-token gap while it is prefilled, the tokens they streamed meanwhile, and its TTFT (the
   shorts ask for 1,000 tokens each, so they are still decoding for the whole prefill: checked, a run where they
   are not is an error);
2. a lone 3,000-token prompt: TTFT;
3. `mixed` at three request rates, SLOs TTFT 2 s / TPOT 100 ms: goodput.

`python benchmarks/bench_token_budget.py` prints the tables and writes the "token_budget" section of
docs/BENCHMARKS.md. Each server runs alone; run it on an idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tokenmill.bench import workloads  # noqa: E402
from tokenmill.bench.machine import memory_bandwidth_gbs  # noqa: E402
from tokenmill.bench.report import machine_description, markdown_table, write_section  # noqa: E402
from tokenmill.bench.server_process import live_server  # noqa: E402
from tokenmill.bench.stats import summarize  # noqa: E402
from tokenmill.bench.sweep_load import load, server_facts  # noqa: E402
from tokenmill.bench.sweep_scenarios import stream_gaps, worst_gap_during_long_prefill  # noqa: E402
from tokenmill.model.loader import bundled_model_path  # noqa: E402
from tokenmill.model.tokenizer import Tokenizer  # noqa: E402

SLO_TTFT, SLO_TPOT = 2.0, 0.1


def server_flags(config: str) -> list[str]:
    """"fixed N" or "target T" -> the serve flags."""
    kind, value = config.split()
    if kind == "fixed":
        return ["--max-num-batched-tokens", value]
    return ["--target-itl-ms", value]


def during_long_prefill(results: list[Any]) -> tuple[float, float, int]:
    """The short streams' worst gap, median gap and token events between the long prompt's arrival and its
    first token."""
    long_result = results[-1]
    start, end = long_result.start, long_result.start + (long_result.ttft or 0.0)
    gaps = [b - a for a, b in stream_gaps(results) if start <= b <= end]
    if not any(t > end for r in results[:-1] for t in r.chunk_times):
        raise RuntimeError("the short streams finished before the long prompt's first token: nothing was measured")
    return worst_gap_during_long_prefill(results), statistics.median(gaps), len(gaps)


def interference(tokenizer: Tokenizer, configs: list[str], seed: int, runs: int) -> list[list[Any]]:
    items = workloads.long_interference(tokenizer, seed, num_short=8, short_output=1000, long_prompt=3000,
                                        long_output=1, long_arrival=1.0)
    lone = workloads.long_interference(tokenizer, seed, num_short=0, long_prompt=3000, long_output=1,
                                       long_arrival=0.0)
    measured: dict[str, list[tuple[float, float, int, float, float]]] = {c: [] for c in configs}
    for run in range(runs):  # interleaved: each run visits every config
        for config in configs:
            with live_server(*server_flags(config), "--no-prefix-caching") as srv:
                server = server_facts(srv.url)
                load(server, lone, seed=seed + 100)  # warm-up (another prompt: no cache either way)
                results, _ = load(server, items, seed=seed)
                alone, _ = load(server, lone, seed=seed)
            worst, median, streamed = during_long_prefill(results)
            measured[config].append((worst, median, streamed, results[-1].ttft or 0.0, alone[-1].ttft or 0.0))
            print(run, config, measured[config][-1], flush=True)

    def cell(values: list[float], scale: float, digits: int) -> str:
        values = sorted(v * scale for v in values)
        middle = round(statistics.median(values), digits)
        return f"{middle:g}" if len(values) == 1 else f"{middle:g} ({values[0]:.{digits}f}-{values[-1]:.{digits}f})"

    base_ttft = statistics.median(m[3] for m in measured[configs[0]])
    rows = []
    for config in configs:
        columns = list(zip(*measured[config]))
        ttft = statistics.median(columns[3])
        rows.append([config, cell(list(columns[0]), 1e3, 0), cell(list(columns[1]), 1e3, 1),
                     cell(list(columns[2]), 1, 0), cell(list(columns[3]), 1, 2), f"{ttft / base_ttft:.2f}x",
                     cell(list(columns[4]), 1, 2)])
    return rows


def goodput(tokenizer: Tokenizer, configs: list[str], rates: list[float], num_requests: int,
            seed: int) -> list[list[Any]]:
    # fresh prompts for each rate (the same ones again would be prefix-cache hits), the same for every config
    items = [workloads.mixed(tokenizer, num_requests, seed + 1 + i) for i in range(len(rates))]
    warmup = workloads.mixed(tokenizer, 16, seed)
    rows = []
    for config in configs:
        row: list[Any] = [config]
        with live_server(*server_flags(config)) as srv:
            server = server_facts(srv.url)
            load(server, warmup, seed=seed)  # every server's first requests pay its cold start
            for rate, rate_items in zip(rates, items):
                results, duration = load(server, rate_items, rate, seed)
                summary = summarize(results, duration, SLO_TTFT, SLO_TPOT)
                row += [round(summary["goodput"], 2), f"{summary['good_share']:.0%}"]
        rows.append(row)
        print(rows[-1], flush=True)
    return rows


SIM_SLO_TPOT = 0.03


def simulated(configs: list[str], rates: list[float]) -> list[list[Any]]:
    """`tokenmill sim sweep` for Llama-3-8B on one H100, `mixed`: goodput and share within the SLOs, one row per
    config, one column pair per rate."""
    rows: dict[str, list[Any]] = {c: [c] for c in configs}
    for rate in rates:
        for kind, flag in (("fixed", "max-num-batched-tokens"), ("target", "target-itl-ms")):
            values = [c.split()[1] for c in configs if c.startswith(kind)]
            command = [sys.executable, "-m", "tokenmill.cli", "sim", "sweep", "--model", "llama-3-8b",
                       "--hardware", "h100-sxm", "--workload", "mixed", "--num-requests", "600",
                       "--request-rate", str(rate), "--slo-ttft", str(SLO_TTFT), "--slo-tpot", str(SIM_SLO_TPOT),
                       "--sweep", flag, "--values", *values]
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            table = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| ")]
            for value, cells in zip(values, table[1:]):  # the header row first
                rows[f"{kind} {value}"] += [float(cells[3]), cells[4].strip()]
    return list(rows.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rates", type=float, nargs=3, default=[2.0, 3.0, 4.0])
    parser.add_argument("--sim-rates", type=float, nargs=3, default=[80.0, 88.0, 95.0])
    parser.add_argument("--runs", type=int, default=2, help="interference runs (interleaved)")
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer = Tokenizer.from_path(bundled_model_path())
    bandwidth = memory_bandwidth_gbs()
    inter = interference(tokenizer, ["fixed 512", "target 50", "target 100"], args.seed, args.runs)
    good = goodput(tokenizer, ["fixed 128", "fixed 256", "fixed 512", "fixed 2048", "target 50", "target 100"],
                   args.rates, args.num_requests, args.seed)
    sim = simulated(["fixed 256", "fixed 512", "fixed 2048", "fixed 8192", "target 20", "target 25", "target 30"],
                    args.sim_rates)
    rate_headers = [h for r in args.rates for h in (f"goodput at {r:g} req/s", "within SLOs")]
    sim_headers = [h for r in args.sim_rates for h in (f"goodput at {r:g} req/s", "within SLOs")]
    body = "\n\n".join([
        "## The self-setting token budget (`--target-itl-ms`)",
        f"{machine_description()}; {bandwidth:.1f} GB/s memory measured in the same run; bundled model, one run "
        f"each, every server alone. `python benchmarks/bench_token_budget.py`",
        f"`long-interference` (8 short streams decoding 1,000 tokens each, a 3,000-token prompt arrives 1 s later) "
        f"and a lone 3,000-token prompt; median of {args.runs} interleaved runs (range):",
        markdown_table(["budget", "shorts' worst gap during the long prefill (ms)", "their median gap (ms)",
                        "tokens they streamed meanwhile", "long prompt TTFT (s)", "vs fixed 512",
                        "lone prompt TTFT (s)"], inter),
        f"`mixed` ({args.num_requests} requests, prompts 32-512, outputs 8-512), SLOs TTFT {SLO_TTFT:g} s / TPOT "
        f"{SLO_TPOT * 1e3:g} ms, goodput in req/s:",
        markdown_table(["budget", *rate_headers], good),
        f"`tokenmill sim`, Llama-3-8B on one H100 (its preset), `mixed` (600 requests), SLOs TTFT {SLO_TTFT:g} s / "
        f"TPOT {SIM_SLO_TPOT * 1e3:g} ms, goodput in req/s (the predictor warm-started from the simulator's cost "
        f"model):",
        markdown_table(["budget", *sim_headers], sim),
    ])
    print(body)
    write_section("token_budget", body)


if __name__ == "__main__":
    main()
