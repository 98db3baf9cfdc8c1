"""The sweep's report: target lines that say "met", "NOT met" or "invalid run" (never "met" on an empty
measurement), the tables with the simulator's prediction beside the measurement, and the plots."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.bench.report import markdown_table
from tokenmill.bench.sweep_load import Capacity, RatePoint, SingleStream, knee_rate
from tokenmill.bench.sweep_scenarios import InterferencePlan, InterferenceRun, PrefixRun
from tokenmill.config import BatchingMode

MODES: tuple[BatchingMode, ...] = ("static", "dynamic", "continuous")
SIM_TOLERANCE = 0.25  # the simulator's prediction is called off where it differs from the measurement by more


@dataclass
class SweepData:
    """Everything one run measured (and the simulator predicted), as the report needs it."""

    model: str
    provenance: str  # date, host, commit, command
    workload: str
    single: SingleStream
    slo_ttft: float
    slo_tpot: float
    slo_source: str
    attainment: float
    capacities: list[Capacity]  # every run, the baselines at each batch size
    best: dict[str, Capacity]  # per mode: the run its rate points use
    points: dict[str, list[RatePoint]]
    simulated_capacity: dict[str, float] = field(default_factory=dict)  # output tok/s per mode
    simulated_points: dict[str, list[RatePoint]] = field(default_factory=dict)
    calibration_note: str = ""
    interference_plan: InterferencePlan | None = None
    interference: dict[str, InterferenceRun] = field(default_factory=dict)
    prefix: dict[str, PrefixRun] = field(default_factory=dict)
    prefix_note: str = ""
    kv: dict[str, dict[str, float]] = field(default_factory=dict)
    elapsed_s: float = 0.0


def ratio_verdict(numerator: float | None, denominator: float | None, target: float,
                  problem: str | None = None) -> str:
    if problem:
        return f"**invalid run** ({problem})"
    if numerator is None or denominator is None or not math.isfinite(numerator) or not math.isfinite(denominator):
        return "**invalid run** (a side was not measured)"
    if denominator <= 0:
        return "**invalid run** (the denominator is zero: nothing was measured)"
    value = numerator / denominator
    return f"**{value:.2f}x** (target >= {target:g}x: {'met' if value >= target else 'NOT met'})"


def knee_verdict(data: SweepData, target: float) -> str:
    knees = {m: knee_rate(data.points[m], data.attainment) for m in ("continuous", "static")}
    lowest_static = min(p.rate for p in data.points["static"])
    if knees["continuous"] is None:
        return "**NOT met** (continuous met the SLOs at none of its rates)" + (
            "" if knees["static"] is None else f"; static's knee {knees['static']:.2f} req/s")
    if knees["static"] is None:
        bound = knees["continuous"] / lowest_static
        return (f"**> {bound:.2f}x** (continuous {knees['continuous']:.2f} req/s; static met the SLOs at none of "
                f"its rates, the lowest {lowest_static:.2f} req/s; target >= {target:g}x: "
                f"{'met (a lower bound)' if bound >= target else 'not shown: sweep static lower'})")
    return ratio_verdict(knees["continuous"], knees["static"], target) + (
        f" ({knees['continuous']:.2f} vs {knees['static']:.2f} req/s)")


def gap_verdict(data: SweepData) -> str:
    runs = data.interference
    chunked, unchunked = runs["chunked, budget 256"], runs["no chunking"]
    problem = chunked.problem or unchunked.problem
    if not problem and unchunked.worst_gap < 0.5:
        problem = f"the gap without chunking is {unchunked.worst_gap:.2f} s, under the 0.5 s the target needs"
    return (ratio_verdict(unchunked.worst_gap, chunked.worst_gap, 3, problem)
            + f" ({unchunked.worst_gap:.2f} s vs {chunked.worst_gap:.2f} s)")


def _pct_off(measured: float, simulated: float) -> float | None:
    if not (math.isfinite(measured) and math.isfinite(simulated)) or measured <= 0:
        return None
    return simulated / measured - 1.0


def _sim_cell(measured: float, simulated: float, digits: int = 2) -> str:
    off = _pct_off(measured, simulated)
    if off is None:
        return "-"
    flag = " **(>25%)**" if abs(off) > SIM_TOLERANCE else ""
    return f"{simulated:.{digits}f} ({off:+.0%}){flag}"


def capacity_table(data: SweepData) -> str:
    rows: list[list[object]] = []
    for c in data.capacities:
        chosen = data.best[c.mode] is c
        sim = _sim_cell(c.output_tokens_per_s, data.simulated_capacity.get(c.mode, math.nan), 0) if chosen else ""
        rows.append([c.mode + (" (chosen)" if chosen and c.mode != "continuous" else ""), c.max_num_seqs,
                     round(c.output_tokens_per_s, 1), round(c.requests_per_s, 2), round(c.window_s, 1),
                     round(c.mean_running, 1), f"{c.mean_kv_usage:.0%}" if math.isfinite(c.mean_kv_usage) else "-",
                     sim])
    return markdown_table(["mode", "max_num_seqs", "output tok/s", "req/s", "window (s)", "running (mean)",
                           "KV blocks in use (mean)", "simulated tok/s (vs measured)"], rows)


def edge_notes(data: SweepData) -> list[str]:
    """A baseline whose best batch is the largest one swept has not shown its best: say so."""
    notes = []
    for mode in ("static", "dynamic"):
        sizes = [c.max_num_seqs for c in data.capacities if c.mode == mode]
        if len(sizes) > 1 and data.best[mode].max_num_seqs == max(sizes):
            notes.append(f"{mode.capitalize()} batching did best at the largest batch swept ({max(sizes)}): it may "
                         "do better at larger ones (`--batch-sizes`).")
    return ["", " ".join(notes)] if notes else []


def rates_table(data: SweepData) -> str:
    rows: list[list[object]] = []
    for mode in MODES:
        simulated = data.simulated_points.get(mode, [])
        for i, p in enumerate(data.points[mode]):  # in the sweep's order: the simulated list lines up
            s = p.summary
            sim = simulated[i].summary if i < len(simulated) else None
            rows.append([mode, f"{p.multiple:.2g}x", round(p.rate, 2), f"{p.num_requests} ({p.num_cut} cut)",
                         round(p.streamed_output_tokens_per_s, 1), f"{s['good_share']:.0%}",
                         f"{sim['good_share']:.0%}" if sim else "-",
                         round(s["ttft_s"]["p50"], 3), round(s["ttft_s"]["p90"], 3),
                         _sim_cell(s["ttft_s"]["p90"], sim["ttft_s"]["p90"], 3) if sim else "-",
                         round(s["tpot_s"]["p50"] * 1e3, 1), round(s["tpot_s"]["p90"] * 1e3, 1),
                         _sim_cell(s["tpot_s"]["p90"] * 1e3, sim["tpot_s"]["p90"] * 1e3, 1) if sim else "-"])
    return markdown_table(["mode", "x capacity", "req/s", "requests", "output tok/s", "within SLOs",
                           "simulated", "TTFT p50 (s)", "TTFT p90 (s)", "simulated p90", "TPOT p50 (ms)",
                           "TPOT p90 (ms)", "simulated p90"], rows)


def knees_line(data: SweepData) -> str:
    parts = []
    for mode in MODES:
        knee = knee_rate(data.points[mode], data.attainment)
        simulated = data.simulated_points.get(mode)
        sim_knee = knee_rate(simulated, data.attainment) if simulated else None
        text = f"{knee:.2f} req/s" if knee is not None else "none of its rates"
        if simulated:
            text += f" (simulated: {f'{sim_knee:.2f} req/s' if sim_knee is not None else 'none'})"
        parts.append(f"{mode} {text}")
    return "; ".join(parts)


def sim_disagreements(data: SweepData) -> list[str]:
    """Every place the prediction is more than 25% off the measurement."""
    out = []
    for mode in MODES:
        off = _pct_off(data.best[mode].output_tokens_per_s, data.simulated_capacity.get(mode, math.nan))
        if off is not None and abs(off) > SIM_TOLERANCE:
            out.append(f"{mode} capacity {off:+.0%}")
        for p, q in zip(data.points[mode], data.simulated_points.get(mode, [])):
            for key, name in (("ttft_s", "TTFT p90"), ("tpot_s", "TPOT p90")):
                off = _pct_off(p.summary[key]["p90"], q.summary[key]["p90"])
                if off is not None and abs(off) > SIM_TOLERANCE:
                    out.append(f"{mode} {p.multiple:.2g}x {name} {off:+.0%}")
    return out


def write_plots(data: SweepData, plots: Path, prefix: str) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots.mkdir(parents=True, exist_ok=True)
    names = {}
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for mode, color in zip(MODES, ("tab:red", "tab:orange", "tab:green")):
        for points, style, label in ((data.points[mode], "-", mode),
                                     (data.simulated_points.get(mode, []), "--", f"{mode} (simulated)")):
            if not points:
                continue
            points = sorted(points, key=lambda p: p.rate)
            rates = [p.rate for p in points]
            axes[0].plot(rates, [p.streamed_output_tokens_per_s for p in points], style, marker="o", color=color,
                         label=label)
            axes[1].plot(rates, [p.summary["good_share"] * 100 for p in points], style, marker="o", color=color)
            axes[2].plot(rates, [p.summary["ttft_s"]["p90"] for p in points], style, marker="o", color=color)
            axes[3].plot(rates, [p.summary["tpot_s"]["p90"] * 1e3 for p in points], style, marker="o", color=color)
            if style == "-":  # the medians, measured only (thin)
                axes[2].plot(rates, [p.summary["ttft_s"]["p50"] for p in points], ":", color=color, linewidth=1)
                axes[3].plot(rates, [p.summary["tpot_s"]["p50"] * 1e3 for p in points], ":", color=color,
                             linewidth=1)
    titles = ["output tokens/s", f"% within SLOs (TTFT <= {data.slo_ttft:.2f} s, TPOT <= {data.slo_tpot * 1e3:.0f} ms)",
              "TTFT p90 (s), dotted p50", "TPOT p90 (ms), dotted p50"]
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("offered rate (req/s)")
        ax.grid(alpha=0.3)
    axes[2].set_yscale("log")
    axes[3].set_yscale("log")
    axes[0].legend(fontsize=7)
    names["rates"] = _save(fig, plots / f"{prefix}rates.png")

    if data.interference:
        fig, ax = plt.subplots(figsize=(8, 4))
        for name, run in data.interference.items():
            xs, ys = zip(*run.timeline) if run.timeline else ((), ())
            ax.scatter(xs, ys, s=6, label=name)
        ax.axvline(0, color="gray", linestyle="--", linewidth=1)
        _axes(ax, "time since the long prompt arrived (s)", "inter-token gap of short streams (s)", log_y=True)
        names["interference"] = _save(fig, plots / f"{prefix}interference.png")

    if data.prefix:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name in ("off", "on"):
            ttfts = data.prefix[name].ttfts
            ax.step(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], where="post",
                    label=f"prefix caching {name}")
        ax.set_xscale("log")
        _axes(ax, "TTFT (s)", "share of requests")
        names["prefix"] = _save(fig, plots / f"{prefix}prefix_ttft_cdf.png")
    return names


def _axes(ax: Any, xlabel: str, ylabel: str, log_y: bool = False) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if log_y:
        ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)


def _save(fig: Any, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name


def report_body(data: SweepData, plots: dict[str, str], title: str, time_target_min: float | None) -> str:
    cont, static = data.best["continuous"], data.best["static"]
    minutes = data.elapsed_s / 60
    duration = f"The whole sweep took {minutes:.1f} minutes"
    if time_target_min is not None:
        duration += f" (target under {time_target_min:g}: {'met' if minutes < time_target_min else 'NOT met'})"
    lines = [
        f"## Serving experiments (`tokenmill bench sweep`): {title}",
        "",
        f"{data.provenance}. {duration}.",
        "",
        f"Workload: {data.workload}. Every run starts `tokenmill serve` (prefix caching off except in part 4) and "
        "drives it over loopback with streaming completions, greedy, EOS ignored. Single stream (the same "
        f"requests one at a time): TTFT {data.single.ttft_s * 1e3:.0f} ms, TPOT {data.single.tpot_s * 1e3:.1f} ms "
        f"(medians); prefill {data.single.prefill_tokens_per_s:.0f} tokens/s. SLOs: TTFT <= {data.slo_ttft:.3f} s "
        f"and TPOT <= {data.slo_tpot * 1e3:.1f} ms ({data.slo_source}); the goodput knee is the highest rate with "
        f">= {data.attainment:.0%} of requests within both.",
        "",
        "### Targets",
        "",
        f"- Continuous (defaults) vs static (its best batch, {static.max_num_seqs}) output throughput at "
        f"saturation: {ratio_verdict(cont.output_tokens_per_s, static.output_tokens_per_s, 3)} "
        f"({cont.output_tokens_per_s:.0f} vs {static.output_tokens_per_s:.0f} tok/s).",
        f"- Goodput knee, continuous vs static: {knee_verdict(data, 3)}.",
    ]
    if data.interference:
        lines.append("- Short streams' worst inter-token gap while the long prompt is prefilled, no chunking vs "
                     f"budget 256 (>= 0.5 s without): {gap_verdict(data)}.")
    if data.prefix:
        off, on = data.prefix["off"].summary["ttft_s"]["mean"], data.prefix["on"].summary["ttft_s"]["mean"]
        lines.append(f"- Prefix caching, mean TTFT off vs on: {ratio_verdict(off, on, 5)} "
                     f"({off * 1e3:.0f} ms vs {on * 1e3:.0f} ms).")
    lines += [
        "",
        "### 1. Capacity: a closed loop per mode",
        "",
        "Twice as many clients as the mode's max_num_seqs, each sending its next request when its last one ends "
        "(a full batch runs while another waits: a static batch always starts full). Tokens are counted from the "
        "max_num_seqs-th answer's end (for static and dynamic batching: the second batch's start) to the last "
        "send: for them whole batch cycles, prefill included (at least two and 64 answers); for continuous "
        "batching 64 answers. Static and dynamic batching run at each batch size and keep their best; continuous "
        f"batching runs at the engine's defaults. {data.calibration_note}",
        "",
        capacity_table(data),
        *edge_notes(data),
        "",
        "### 2. Poisson rates from a quarter to 1.5x of each mode's capacity",
        "",
        "Each mode at the batch size chosen above; the same requests (by seed) at the same multiple of capacity for "
        "every mode (where static batching met the SLOs at none of them, one more static point at a third of "
        "continuous batching's knee decides the knee target). A point's requests are cut at a deadline past the "
        "last arrival by TTFT SLO + TPOT SLO x the longest output + 1 s: a request still open then could not "
        "have met the SLOs, so it counts outside them "
        "(and its tokens count in the throughput). Latency percentiles are over the requests that finished. "
        f"Goodput knee: {knees_line(data)}.",
        "",
        rates_table(data),
        "",
        f"![throughput and latency versus rate](plots/{plots['rates']})",
    ]
    disagreements = sim_disagreements(data)
    if data.simulated_points:
        lines += ["", "Where the simulator is more than 25% off: " + (", ".join(disagreements) if disagreements
                                                                        else "nowhere") + "."]
    if data.interference and data.interference_plan:
        plan = data.interference_plan
        lines += [
            "",
            f"### 3. Chunked prefill: 4 streams decoding when a {plan.long_prompt}-token prompt arrives",
            "",
            f"The long prompt is sized from the prefill speed measured above to take >= 2 s alone (estimated "
            f"{plan.estimated_prefill_s:.1f} s), arrives {plan.arrival_s:g} s after the short streams start, and "
            f"the short streams decode {plan.short_output} tokens each so that they outlast it; a run where they "
            "do not overlap it is reported invalid, not measured.",
            "",
            markdown_table(["configuration", "worst gap during the long prefill (s)", "median gap before (s)",
                            "long prompt TTFT (s)", "valid"],
                           [[n, round(r.worst_gap, 3), round(r.median_gap_before, 3), round(r.long_ttft, 2),
                             r.problem or "yes"] for n, r in data.interference.items()]),
            "",
            f"![inter-token gaps](plots/{plots['interference']})",
        ]
    if data.prefix:
        lines += [
            "",
            f"### 4. Prefix caching: {data.prefix_note}",
            "",
            markdown_table(["prefix caching", "TTFT mean (s)", "TTFT p50 (s)", "TTFT p90 (s)", "hit rate"],
                           [[name, round(r.summary["ttft_s"]["mean"], 3), round(r.summary["ttft_s"]["p50"], 3),
                             round(r.summary["ttft_s"]["p90"], 3), f"{r.hit_rate:.1%}"]
                            for name, r in data.prefix.items()]),
            "",
            f"![TTFT distribution](plots/{plots['prefix']})",
        ]
    if data.kv:
        lines += [
            "",
            "### 5. KV memory holding real tokens (offline, the same workload, each mode at its chosen batch)",
            "",
            markdown_table(["mode", "real tokens / held KV slots", "blocks in use (mean)", "output tok/s"],
                           [[m, f"{r['kv_real_share']:.1%}", f"{r['kv_usage']:.1%}", round(r["tokens_per_s"], 1)]
                            for m, r in data.kv.items()]),
        ]
    return "\n".join(lines)
