"""What swapping a model's version costs its clients: `tokenmill serve --model chat=FILE` under a steady load of
short streamed completions (4 clients, one request after another each), `POST /admin/models/chat/reload` to a
copy of the same file halfway. Reports the swap's duration (load beside the old version, probe, switch), the
requests that failed (the target is 0), and the latency of requests before, during and after the swap
(p50 / p99 of TTFT and of the whole request). Repeated; the machine's own limits measured in the same run."""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tokenmill.bench.machine import gemm_gflops, memory_bandwidth_gbs  # noqa: E402
from tokenmill.bench.report import machine_description, markdown_table, write_section  # noqa: E402
from tokenmill.bench.server_process import live_server  # noqa: E402
from tokenmill.model.metadata import resolve_model_path  # noqa: E402

CLIENTS = 4


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def one_run(model: str, warm_s: float, after_s: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as directory:
        first, second = Path(directory) / "chat.gguf", Path(directory) / "chat-v2.gguf"
        shutil.copyfile(model, first)
        shutil.copyfile(model, second)
        with live_server(f"--model=chat={first}", "--admin-api-key", "bench") as server:
            url = server.url
            records: list[tuple[float, float, float, bool]] = []  # (start, ttft, total, ok)
            stop = threading.Event()

            def client() -> None:
                with httpx.Client(timeout=120) as http:
                    while not stop.is_set():
                        start = time.monotonic()
                        first_token, ok = None, False
                        try:
                            with http.stream("POST", url + "/v1/completions", json={
                                    "model": "chat", "prompt": "Write one line about the sea.", "max_tokens": 24,
                                    "stream": True}) as reply:
                                for line in reply.iter_lines():
                                    if line.startswith("data: {") and first_token is None:
                                        first_token = time.monotonic()
                                    if line == "data: [DONE]":  # blank lines separate the events after it too
                                        ok = reply.status_code == 200
                        except httpx.HTTPError:
                            ok = False
                        end = time.monotonic()
                        records.append((start, (first_token or end) - start, end - start, ok))

            httpx.post(url + "/v1/completions", json={"model": "chat", "prompt": "hi", "max_tokens": 2}, timeout=120)
            threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
            for thread in threads:
                thread.start()
            time.sleep(warm_s)
            swap_start = time.monotonic()
            reply = httpx.post(url + "/admin/models/chat/reload", json={"path": str(second)},
                               headers={"Authorization": "Bearer bench"}, timeout=600)
            swap_end = time.monotonic()
            time.sleep(after_s)
            stop.set()
            for thread in threads:
                thread.join(120)
    assert reply.status_code == 200, reply.text
    phases = {"before": [r for r in records if r[0] < swap_start],
              "during": [r for r in records if swap_start <= r[0] < swap_end],
              "after": [r for r in records if r[0] >= swap_end]}
    return {"swap_s": swap_end - swap_start, "failed": sum(not r[3] for r in records), "requests": len(records),
            "phases": {name: {"n": len(rs), "ttft_p50": _percentile([r[1] for r in rs], 0.5),
                              "ttft_p99": _percentile([r[1] for r in rs], 0.99),
                              "total_p50": _percentile([r[2] for r in rs], 0.5),
                              "total_p99": _percentile([r[2] for r in rs], 0.99)} for name, rs in phases.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2)")
    parser.add_argument("--repeats", type=int, default=3, help="runs (each with a fresh server)")
    parser.add_argument("--warm-s", type=float, default=5.0, help="seconds of load before the swap")
    parser.add_argument("--after-s", type=float, default=5.0, help="seconds of load after it")
    parser.add_argument("--no-write", action="store_true", help="print only (do not update docs/BENCHMARKS.md)")
    args = parser.parse_args()
    model = resolve_model_path(args.model)
    gemm, bandwidth = gemm_gflops("none"), memory_bandwidth_gbs()
    runs = []
    for i in range(args.repeats):
        run = one_run(model, args.warm_s, args.after_s)
        runs.append(run)
        print(f"run {i + 1}: swap {run['swap_s']:.2f} s, {run['failed']} of {run['requests']} requests failed",
              flush=True)
    rows = []
    for phase in ("before", "during", "after"):
        stats = [r["phases"][phase] for r in runs]  # type: ignore[index]
        rows.append([phase, sum(s["n"] for s in stats)] + [
            f"{statistics.median(s[key] for s in stats) * 1000:.0f} ({min(s[key] for s in stats) * 1000:.0f}-"
            f"{max(s[key] for s in stats) * 1000:.0f})" for key in ("ttft_p50", "ttft_p99", "total_p50", "total_p99")])
    swaps = [float(r["swap_s"]) for r in runs]  # type: ignore[arg-type]
    failed = sum(int(r["failed"]) for r in runs)  # type: ignore[call-overload]
    body = (f"## Swapping a model's version (`python benchmarks/bench_swap.py`)\n\n{machine_description()}; "
            f"float32 GEMM {gemm:.0f} GFLOP/s, memory copy {bandwidth:.1f} GB/s, measured in the same run.\n\n"
            f"File {Path(model).name}; {CLIENTS} clients streaming 24-token completions back to back, the reload "
            f"(load beside the serving version, probe, switch, the old one drains) after {args.warm_s:g} s; "
            f"{args.repeats} runs, each with a fresh server.\n\n"
            f"Swap duration: median {statistics.median(swaps):.2f} s (min {min(swaps):.2f}, max {max(swaps):.2f}). "
            f"Failed requests: {failed} of {sum(int(r['requests']) for r in runs)} (target 0).\n\n"  # type: ignore[call-overload]
            + markdown_table(["requests that started", "count", "TTFT p50 ms", "TTFT p99 ms", "request p50 ms",
                              "request p99 ms"], rows)
            + "\n\nLatency cells: median over runs (min-max).\n")
    print(body)
    if not args.no_write:
        write_section("model_swap", body)


if __name__ == "__main__":
    main()
