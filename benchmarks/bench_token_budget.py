"""The self-setting token budget (`--target-itl-ms`) against fixed budgets, side by side in one run on this
machine (bundled model), and the same comparison in `tokenmill sim` for Llama-3-8B on an H100:

1. `long-interference`: 8 short streams decoding when a 3,000-token prompt arrives: the short streams' worst
   inter-token gap while it is prefilled, and its TTFT;
2. a lone 3,000-token prompt: TTFT;
3. `mixed` at three request rates, SLOs TTFT 2 s / TPOT 100 ms: goodput.

`python benchmarks/bench_token_budget.py` prints the tables and writes the "token_budget" section of
docs/BENCHMARKS.md. Each server runs alone; run it on an idle machine.
"""

from __future__ import annotations

import argparse
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
from tokenmill.bench.sweep import _load, worst_gap_during_long_prefill  # noqa: E402
from tokenmill.model.loader import bundled_model_path  # noqa: E402
from tokenmill.model.tokenizer import Tokenizer  # noqa: E402

SLO_TTFT, SLO_TPOT = 2.0, 0.1


def server_flags(config: str) -> list[str]:
    """"fixed N" or "target T" -> the serve flags."""
    kind, value = config.split()
    if kind == "fixed":
        return ["--max-num-batched-tokens", value]
    return ["--target-itl-ms", value]


def interference(tokenizer: Tokenizer, configs: list[str], seed: int) -> list[list[Any]]:
    items = workloads.long_interference(tokenizer, seed, num_short=8, short_output=200, long_prompt=3000)
    lone = workloads.long_interference(tokenizer, seed, num_short=0, long_prompt=3000, long_output=1,
                                       long_arrival=0.0)
    rows = []
    for config in configs:
        with live_server(*server_flags(config), "--no-prefix-caching") as server:
            results, _ = _load(server.url, items, float("inf"), seed)
            alone, _ = _load(server.url, lone, float("inf"), seed)
        rows.append([config, round(worst_gap_during_long_prefill(results) * 1e3), round(results[-1].ttft or 0, 2),
                     round(alone[-1].ttft or 0, 2)])
        print(rows[-1], flush=True)
    return rows


def goodput(tokenizer: Tokenizer, configs: list[str], rates: list[float], num_requests: int,
            seed: int) -> list[list[Any]]:
    # fresh prompts for each rate (the same ones again would be prefix-cache hits), the same for every config
    items = [workloads.mixed(tokenizer, num_requests, seed + 1 + i) for i in range(len(rates))]
    warmup = workloads.mixed(tokenizer, 16, seed)
    rows = []
    for config in configs:
        row: list[Any] = [config]
        with live_server(*server_flags(config)) as server:
            _load(server.url, warmup, float("inf"), seed)  # every server's first requests pay its cold start
            for rate, rate_items in zip(rates, items):
                results, duration = _load(server.url, rate_items, rate, seed)
                summary = summarize(results, duration, SLO_TTFT, SLO_TPOT)
                row += [round(summary["goodput"], 2), f"{summary['good_share']:.0%}"]
        rows.append(row)
        print(rows[-1], flush=True)
    return rows


def simulated(sweep: str, values: list[str], rate: float) -> str:
    """`tokenmill sim sweep` for Llama-3-8B on one H100, mixed workload: its table."""
    command = [sys.executable, "-m", "tokenmill.cli", "sim", "sweep", "--model", "llama-3-8b", "--hardware",
               "h100-sxm", "--workload", "mixed", "--num-requests", "600", "--request-rate", str(rate),
               "--slo-ttft", str(SLO_TTFT), "--slo-tpot", "0.03", "--sweep", sweep, "--values", *values]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return "\n".join(line for line in out.splitlines() if line.startswith("|"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rates", type=float, nargs=3, default=[2.0, 4.0, 6.0])
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer = Tokenizer.from_path(bundled_model_path())
    bandwidth = memory_bandwidth_gbs()
    inter = interference(tokenizer, ["fixed 512", "target 50", "target 100"], args.seed)
    good = goodput(tokenizer, ["fixed 128", "fixed 256", "fixed 512", "fixed 2048", "target 50", "target 100"],
                   args.rates, args.num_requests, args.seed)
    sim_fixed = simulated("max-num-batched-tokens", ["512", "2048", "8192"], 80.0)
    sim_target = simulated("target-itl-ms", ["15", "25", "50"], 80.0)
    rate_headers = [h for r in args.rates for h in (f"goodput at {r:g} req/s", "within SLOs")]
    body = "\n\n".join([
        "## The self-setting token budget (`--target-itl-ms`)",
        f"{machine_description()}; {bandwidth:.1f} GB/s memory measured in the same run; bundled model, one run "
        f"each, every server alone. `python benchmarks/bench_token_budget.py`",
        "`long-interference` (8 short streams decoding, a 3,000-token prompt arrives) and a lone 3,000-token "
        "prompt:",
        markdown_table(["budget", "short streams' worst gap during the long prefill (ms)", "long prompt TTFT (s)",
                        "lone prompt TTFT (s)"], inter),
        f"`mixed` ({args.num_requests} requests, prompts 32-512, outputs 8-512), SLOs TTFT {SLO_TTFT:g} s / TPOT "
        f"{SLO_TPOT * 1e3:g} ms, goodput in req/s:",
        markdown_table(["budget", *rate_headers], good),
        "`tokenmill sim`, Llama-3-8B on one H100, `mixed` at 80 req/s, SLOs TTFT 2 s / TPOT 30 ms: fixed budgets",
        sim_fixed, "and the target:", sim_target,
    ])
    print(body)
    write_section("token_budget", body)


if __name__ == "__main__":
    main()
