"""Chaos: `--data-parallel-size 2` under `mixed` load while an engine core is SIGKILLed every 20-30 s.

The bundled model, default flags, two replicas. The same `mixed` workload (greedy, Poisson arrivals) runs
twice, on two fresh servers: undisturbed, then with a killer that SIGKILLs one replica's engine-core process
(alternating, only while both are up) at random intervals of 20-30 s until the load is done. Reported: failed
requests (target 0), greedy outputs equal to the undisturbed run's (target: all), TTFT and ITL p50/p99 of both
runs, the requests moved (tokenmill:request_migrations_total) and the longest gap between two tokens that a
moved stream saw (the detection, the restart or routing elsewhere, and the recomputation of prompt + output).

`python benchmarks/bench_chaos.py` prints the table and writes the "chaos" section of docs/BENCHMARKS.md. Run it
on an idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import threading
import time
from typing import Any

import httpx

from tokenmill.bench import workloads
from tokenmill.bench.loadgen import run_load
from tokenmill.bench.report import machine_description, markdown_table, write_section
from tokenmill.bench.server_process import live_server
from tokenmill.bench.stats import RequestResult, percentiles
from tokenmill.model.loader import load_model
from tokenmill.model.tokenizer import Tokenizer

MODEL = "SmolLM2-135M-Instruct"
FLAGS = ("--data-parallel-size", "2", "--disable-log-stats")
MOVED = re.compile(r"request (\S+)-\d+ moved from engine core")


def metric_sum(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def kill_every(url: str, interval: tuple[float, float], stop: threading.Event, seed: int,
               kills: list[tuple[float, int]]) -> None:
    """SIGKILL a replica's engine core every `interval` seconds (drawn at random), alternating replicas, only
    while every replica is up (a kill during a restart would only stretch the restart)."""
    rng = random.Random(seed)
    start = time.monotonic()
    victim = 0
    while not stop.wait(rng.uniform(*interval)):
        while not stop.is_set() and httpx.get(url + "/health").json()["status"] != "ok":
            time.sleep(0.2)
        if stop.is_set():
            return
        pid = httpx.get(url + "/health").json()["replicas"][victim]["pid"]
        os.kill(pid, signal.SIGKILL)
        kills.append((time.monotonic() - start, victim))
        victim = 1 - victim


def run(url: str, items: list[workloads.WorkItem], rate: float, seed: int) -> tuple[list[RequestResult], float]:
    return asyncio.run(run_load(url, MODEL, items, rate, seed=seed, token_prompts=True, progress=False))


def latency_row(label: str, results: list[RequestResult], duration: float) -> list[Any]:
    ok = [r for r in results if r.ok]
    ttft = percentiles([r.ttft for r in ok if r.ttft is not None], (50, 99))
    itl = percentiles([x for r in ok for x in r.itls], (50, 99))
    return [label, len(results) - len(ok), f"{duration:.0f}", f"{1e3 * ttft['p50']:.0f}", f"{1e3 * ttft['p99']:.0f}",
            f"{1e3 * itl['p50']:.1f}", f"{1e3 * itl['p99']:.1f}", f"{1e3 * max(x for r in ok for x in r.itls):.0f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=500)
    parser.add_argument("--request-rate", type=float, default=5.0)
    parser.add_argument("--kill-interval", type=float, nargs=2, default=(20.0, 30.0))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    loaded = load_model(None)
    tokenizer = Tokenizer.from_path(loaded.path, loaded.gguf_reader)
    items = workloads.mixed(tokenizer, args.num_requests, seed=args.seed)
    # Two servers of the same flags, one per run: the second run must not find the first one's prompts cached.
    with live_server(*FLAGS) as server:
        calm, calm_s = run(server.url, items, args.request_rate, args.seed)
    log: list[str] = []
    with live_server(*FLAGS) as server:
        assert server.proc.stdout is not None
        stdout = server.proc.stdout
        reader = threading.Thread(target=lambda: log.extend(stdout), daemon=True)
        reader.start()
        url = server.url
        stop = threading.Event()
        kills: list[tuple[float, int]] = []
        killer = threading.Thread(target=kill_every, args=(url, tuple(args.kill_interval), stop, args.seed, kills))
        killer.start()
        chaos, chaos_s = run(url, items, args.request_rate, args.seed)
        stop.set()
        killer.join()
        migrations = metric_sum(url, "tokenmill:request_migrations_total")
        restarts = metric_sum(url, "tokenmill:replica_restarts_total")
    moved_ids = {m.group(1) for line in log if (m := MOVED.search(line))}
    moved = [r for r in chaos if r.request_id in moved_ids]
    equal = sum(a.ok and b.ok and a.text == b.text for a, b in zip(calm, chaos))
    longest_moved = max((max(r.itls, default=0.0) for r in moved), default=0.0)

    table = markdown_table(
        ["run", "failed", "seconds", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "longest gap ms"],
        [latency_row("undisturbed", calm, calm_s), latency_row(f"{len(kills)} cores SIGKILLed", chaos, chaos_s)])
    summary = (f"{len(items)} `mixed` requests at {args.request_rate} req/s (greedy, seed {args.seed}); kills at "
               f"{', '.join(f'{t:.0f} s (core {v})' for t, v in kills)}; {restarts:.0f} restarts. "
               f"Failed requests under kills: {sum(not r.ok for r in chaos)}. Outputs equal to the undisturbed "
               f"run's: {equal} of {len(items)}. Requests moved: {migrations:.0f} "
               f"({len(moved)} client requests); the longest gap a moved stream saw: {1e3 * longest_moved:.0f} ms.")
    errors = sorted({r.error or "" for r in chaos if not r.ok})
    if errors:
        summary += f" Errors: {'; '.join(e[:160] for e in errors[:3])}."
    print(table)
    print(summary)
    if not args.no_write:
        write_section("chaos", "\n".join([
            "## Chaos: an engine core SIGKILLed every 20-30 s (`benchmarks/bench_chaos.py`)", "",
            f"Machine: {machine_description()}", "",
            "`--data-parallel-size 2`, the bundled model with default flags; the same workload runs undisturbed, "
            "then with one replica's engine core SIGKILLed at random intervals (alternating replicas, only while "
            "both are up). A dead core's requests move to the other replica and continue from the tokens they "
            "streamed (engine/migration.py).", "", table, "", summary, ""]))


if __name__ == "__main__":
    main()
