"""`tokenmill bench sweep`: the serving experiments end to end on this machine, into docs/BENCHMARKS.md and
PNG plots under docs/plots/.

1. throughput and TTFT/TPOT versus request rate for static, dynamic and continuous batching (same engine);
2. the short streams' inter-token gaps when a ~3,000-token prompt arrives, chunked prefill on and off;
3. TTFT on a shared-prefix workload with prefix caching on and off, and the hit rate;
4. KV memory holding real tokens versus reserved, paged versus static reservation.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import httpx

from tokenmill.bench import workloads
from tokenmill.bench.loadgen import run_load
from tokenmill.bench.offline import run_offline
from tokenmill.bench.report import DOC, machine_description, markdown_table, write_section
from tokenmill.bench.server_process import live_server
from tokenmill.bench.stats import RequestResult, summarize
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.model.loader import load_model
from tokenmill.model.tokenizer import Tokenizer
from tokenmill.server.metrics import metric_value

MODEL = "SmolLM2-135M-Instruct"
PLOTS = DOC.parent / "plots"


def _load(url: str, items: list[workloads.WorkItem], rate: float, seed: int) -> tuple[list[RequestResult], float]:
    return asyncio.run(run_load(url, MODEL, items, rate, seed=seed, progress=True, token_prompts=True))


def _save(fig: Any, name: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(PLOTS / name, dpi=110)
    plt.close(fig)
    return name


# ------------------------------------------------------------------ 1. batching modes vs request rate


def exp_rates(tokenizer: Tokenizer, args: argparse.Namespace) -> dict[str, Any]:
    modes = ["static", "dynamic", "continuous"]
    rates = args.rates
    out: dict[str, dict[float, dict[str, Any]]] = {m: {} for m in modes}
    for mode in modes:
        with live_server("--batching", mode, "--max-num-seqs", str(args.max_num_seqs), "--no-prefix-caching") as srv:
            for i, rate in enumerate(rates):
                items = workloads.mixed(tokenizer, args.num_requests, seed=args.seed + i,
                                        output_range=(8, args.max_output))
                results, duration = _load(srv.url, items, rate, args.seed + i)
                summary = summarize(results, duration, args.slo_ttft, args.slo_tpot)
                out[mode][rate] = summary
                print(f"  {mode:>10} rate {rate:>5}: {summary['output_throughput']:6.1f} tok/s, "
                      f"TTFT p50 {summary['ttft_s']['p50']:.2f} s, TPOT p50 {summary['tpot_s']['p50']:.3f} s, "
                      f"good {summary['good_share']:.0%}", flush=True)
    return {"modes": modes, "rates": rates, "results": out}


def plot_rates(data: dict[str, Any]) -> str:
    import matplotlib.pyplot as plt

    rates = data["rates"]
    labels = [("burst" if r == float("inf") else f"{r:g}") for r in rates]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for mode in data["modes"]:
        res = [data["results"][mode][r] for r in rates]
        axes[0].plot(labels, [s["output_throughput"] for s in res], marker="o", label=mode)
        axes[1].plot(labels, [s["ttft_s"]["p50"] for s in res], marker="o", label=mode)
        axes[2].plot(labels, [s["tpot_s"]["p50"] for s in res], marker="o", label=mode)
    for ax, title in zip(axes, ["output tokens/s", "TTFT p50 (s)", "TPOT p50 (s)"]):
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    return _save(fig, "rates.png")


# ------------------------------------------------------------------ 2. long prompt interference


def stream_gaps(results: list[RequestResult]) -> list[tuple[float, float]]:
    """(previous chunk time, chunk time) of every consecutive pair in the short streams (all but the last)."""
    return [(a, b) for r in results[:-1] for a, b in zip(r.chunk_times, r.chunk_times[1:])]


def worst_gap_during_long_prefill(results: list[RequestResult]) -> float:
    """`long-interference`: the longest stall of a short stream between the long prompt's arrival (the last
    request) and its first token (+0.5 s)."""
    long_result = results[-1]
    end = long_result.start + (long_result.ttft or 0.0) + 0.5
    return max((b - a for a, b in stream_gaps(results) if b >= long_result.start and a <= end), default=0.0)


def exp_interference(tokenizer: Tokenizer, args: argparse.Namespace) -> dict[str, Any]:
    items = workloads.long_interference(tokenizer, args.seed, long_prompt=args.long_prompt)
    configs = [("chunked, budget 256", 256), ("chunked, budget 1024", 1024), ("no chunking", 4096)]
    out = {}
    for name, budget in configs:
        with live_server("--max-num-batched-tokens", str(budget), "--no-prefix-caching") as srv:
            results, _ = _load(srv.url, items, float("inf"), args.seed)
        long_result = results[-1]
        pairs = stream_gaps(results)
        gaps_before = [b - a for a, b in pairs if b < long_result.start]
        timeline = [(b - long_result.start, b - a) for a, b in pairs]
        out[name] = {"budget": budget, "worst_gap": worst_gap_during_long_prefill(results),
                     "median_gap_before": statistics.median(gaps_before) if gaps_before else 0.0,
                     "long_ttft": long_result.ttft, "timeline": timeline}
        print(f"  {name:>22}: worst gap during long prefill {out[name]['worst_gap']:.2f} s, "
              f"long TTFT {long_result.ttft:.1f} s", flush=True)
    return out


def plot_interference(data: dict[str, Any]) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, d in data.items():
        xs, ys = zip(*d["timeline"]) if d["timeline"] else ((), ())
        ax.scatter(xs, ys, s=8, label=name)
    ax.axvline(0, color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel("time since the long prompt arrived (s)")
    ax.set_ylabel("inter-token gap of short streams (s)")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, "interference.png")


# ------------------------------------------------------------------ 3. prefix caching


def exp_prefix(tokenizer: Tokenizer, args: argparse.Namespace) -> dict[str, Any]:
    items = workloads.shared_prefix(tokenizer, args.prefix_requests, args.seed)
    out = {}
    for caching in (False, True):
        flags = [] if caching else ["--no-prefix-caching"]
        with live_server(*flags) as srv:
            results, duration = _load(srv.url, items, args.prefix_rate, args.seed)
            text = httpx.get(srv.url + "/metrics").text
        queries = metric_value(text, "tokenmill:prefix_cache_queries_total") or 0.0
        hits = metric_value(text, "tokenmill:prefix_cache_hits_total") or 0.0
        summary = summarize(results, duration)
        out["on" if caching else "off"] = {"summary": summary, "hit_rate": hits / queries if queries else 0.0,
                                           "ttfts": sorted(r.ttft for r in results if r.ttft is not None)}
        print(f"  prefix caching {'on ' if caching else 'off'}: TTFT mean {summary['ttft_s']['mean']:.2f} s, "
              f"hit rate {out['on' if caching else 'off']['hit_rate']:.1%}", flush=True)
    return out


def plot_prefix(data: dict[str, Any]) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("off", "on"):
        ttfts = data[name]["ttfts"]
        ax.step(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], where="post",
                label=f"prefix caching {name}")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of requests")
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, "prefix_ttft_cdf.png")


# ------------------------------------------------------------------ 4. KV memory


def exp_kv(tokenizer: Tokenizer, args: argparse.Namespace) -> dict[str, Any]:
    loaded = load_model(None)
    items = workloads.mixed(tokenizer, args.kv_requests, seed=args.seed, output_range=(8, args.max_output))
    out = {}
    for mode in ("static", "continuous"):
        config = EngineConfig(batching=mode, max_num_seqs=args.max_num_seqs, enable_prefix_caching=False)
        engine = LLMEngine.from_loaded(config, loaded, tokenizer)
        out[mode] = run_offline(engine, items)
        print(f"  {mode:>10}: real tokens / reserved slots {out[mode]['kv_real_share']:.1%}", flush=True)
    return out


def plot_kv(data: dict[str, Any]) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    names = ["static (reserved)", "paged (continuous)"]
    shares = [data["static"]["kv_real_share"] * 100, data["continuous"]["kv_real_share"] * 100]
    ax.bar(names, shares, color=["tab:red", "tab:green"])
    ax.set_ylabel("% of held KV slots holding real tokens")
    ax.set_ylim(0, 100)
    for i, v in enumerate(shares):
        ax.text(i, v + 1, f"{v:.0f}%", ha="center")
    return _save(fig, "kv_memory.png")


# ------------------------------------------------------------------ report


def _sustained(results: dict[float, dict[str, Any]], share: float) -> str:
    ok = [r for r, s in results.items() if r != float("inf") and s["good_share"] >= share]
    return f"{max(ok):g} req/s" if ok else "none of the tested rates"


def write_report(args: argparse.Namespace, rates: dict[str, Any], inter: dict[str, Any], prefix: dict[str, Any],
                 kv: dict[str, Any], plots: dict[str, str], elapsed: float) -> None:
    rate_rows = []
    for mode in rates["modes"]:
        for rate, s in rates["results"][mode].items():
            rate_rows.append([mode, "burst" if rate == float("inf") else f"{rate:g}",
                              round(s["output_throughput"], 1), round(s["request_throughput"], 3),
                              round(s["ttft_s"]["p50"], 2), round(s["ttft_s"]["p90"], 2),
                              round(s["tpot_s"]["p50"], 3), round(s["tpot_s"]["p90"], 3),
                              f"{s['good_share']:.0%}"])
    top_rate = max(rates["rates"])
    cont = rates["results"]["continuous"][top_rate]["output_throughput"]
    stat = rates["results"]["static"][top_rate]["output_throughput"]
    gain = cont / stat if stat else float("inf")
    chunked = inter["chunked, budget 256"]["worst_gap"]
    unchunked = inter["no chunking"]["worst_gap"]
    gap_ratio = unchunked / chunked if chunked else float("inf")
    off, on = prefix["off"]["summary"], prefix["on"]["summary"]
    ttft_ratio = off["ttft_s"]["mean"] / on["ttft_s"]["mean"] if on["ttft_s"]["mean"] else float("inf")

    def verdict(value: float, target: float) -> str:
        return f"**{value:.2f}x** (target >= {target:g}x: {'met' if value >= target else 'NOT met'})"

    body = "\n".join([
        "## Serving experiments (`tokenmill bench sweep`)",
        "",
        f"Machine: {machine_description()}. Each experiment starts `tokenmill serve` on the bundled model "
        f"and drives it over loopback with `tokenmill bench serve`'s load generator (streaming completions, "
        f"greedy, EOS ignored). The whole sweep took {elapsed / 60:.1f} minutes.",
        "",
        "### Targets",
        "",
        f"- Continuous vs static output throughput on `mixed` (burst load): {verdict(gain, 2)}.",
        f"- Short streams' worst inter-token gap while a {args.long_prompt}-token prompt is prefilled, without vs "
        f"with chunked prefill (budget 256): {verdict(gap_ratio, 3)} ({unchunked:.2f} s vs {chunked:.2f} s).",
        f"- Mean TTFT on `shared-prefix`, prefix caching off vs on: {verdict(ttft_ratio, 3)} "
        f"({off['ttft_s']['mean']:.2f} s vs {on['ttft_s']['mean']:.2f} s).",
        "",
        f"### 1. Batching modes versus request rate (`mixed`, {args.num_requests} requests per point, prompts "
        f"32-512 tokens, outputs 8-{args.max_output} heavy-tailed, max_num_seqs={args.max_num_seqs})",
        "",
        "Each rate point has its own seeded workload (the same one for all three modes): compare modes within a "
        "rate. " + f"SLO: TTFT <= {args.slo_ttft} s and TPOT <= {args.slo_tpot} s; \"good\" is the share of requests "
        "within both (goodput). Highest tested Poisson rate with >= 90% good requests: " + ", ".join(
            f"{m} {_sustained(rates['results'][m], 0.9)}" for m in rates["modes"]) + ".",
        "",
        markdown_table(["mode", "rate (req/s)", "output tok/s", "req/s", "TTFT p50 (s)", "TTFT p90 (s)",
                        "TPOT p50 (s)", "TPOT p90 (s)", "good"], rate_rows),
        "",
        f"![throughput and latency versus rate](plots/{plots['rates']})",
        "",
        f"### 2. Chunked prefill: short streams while a {args.long_prompt}-token prompt arrives (`long-interference`)",
        "",
        markdown_table(["configuration", "worst gap during long prefill (s)", "median gap before (s)",
                        "long prompt TTFT (s)"],
                       [[n, round(d["worst_gap"], 2), round(d["median_gap_before"], 3), round(d["long_ttft"], 1)]
                        for n, d in inter.items()]),
        "",
        f"![inter-token gaps](plots/{plots['interference']})",
        "",
        f"### 3. Prefix caching (`shared-prefix`: {args.prefix_requests} requests sharing a 768-token preamble, "
        f"Poisson {args.prefix_rate:g} req/s)",
        "",
        markdown_table(["prefix caching", "TTFT mean (s)", "TTFT p50 (s)", "TTFT p90 (s)", "hit rate"],
                       [[name, round(prefix[name]["summary"]["ttft_s"]["mean"], 2),
                         round(prefix[name]["summary"]["ttft_s"]["p50"], 2),
                         round(prefix[name]["summary"]["ttft_s"]["p90"], 2), f"{prefix[name]['hit_rate']:.1%}"]
                        for name in ("off", "on")]),
        "",
        f"![TTFT distribution](plots/{plots['prefix']})",
        "",
        f"### 4. KV memory holding real tokens (offline, `mixed`, {args.kv_requests} requests)",
        "",
        markdown_table(["allocation", "real tokens / held slots", "blocks in use (mean)"],
                       [["static reservation (prompt + max_tokens up front)",
                         f"{kv['static']['kv_real_share']:.1%}", f"{kv['static']['kv_usage']:.1%}"],
                        ["paged, on demand (continuous)", f"{kv['continuous']['kv_real_share']:.1%}",
                         f"{kv['continuous']['kv_usage']:.1%}"]]),
        "",
        f"![KV memory](plots/{plots['kv']})",
    ])
    write_section("serving", body)


def add_args(parser: argparse.ArgumentParser) -> None:
    # More requests than batch slots: refilling freed slots is what continuous batching adds.
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, float("inf")])
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--slo-ttft", type=float, default=5.0)
    parser.add_argument("--slo-tpot", type=float, default=0.4)
    parser.add_argument("--long-prompt", type=int, default=3000)
    parser.add_argument("--prefix-requests", type=int, default=20)
    parser.add_argument("--prefix-rate", type=float, default=0.5)
    parser.add_argument("--kv-requests", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> int:
    PLOTS.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    start = time.perf_counter()
    loaded = load_model(None)
    tokenizer = Tokenizer.from_path(loaded.path, loaded.gguf_reader)
    del loaded
    print("1/4 batching modes versus request rate", flush=True)
    rates = exp_rates(tokenizer, args)
    print("2/4 long-prompt interference", flush=True)
    inter = exp_interference(tokenizer, args)
    print("3/4 prefix caching", flush=True)
    prefix = exp_prefix(tokenizer, args)
    print("4/4 KV memory", flush=True)
    kv = exp_kv(tokenizer, args)
    plots = {"rates": plot_rates(rates), "interference": plot_interference(inter), "prefix": plot_prefix(prefix),
             "kv": plot_kv(kv)}
    write_report(args, rates, inter, prefix, kv, plots, time.perf_counter() - start)
    print(f"wrote {DOC} and {PLOTS}/ in {(time.perf_counter() - start) / 60:.1f} min")
    return 0

