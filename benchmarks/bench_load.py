"""Start to ready and peak memory per model file: `tokenmill serve MODEL` against llama.cpp's `llama-server` on the
same file, each started alone, one after the other, in one run.

Ready: from the process's start until `/v1/models` answers and a first 8-token completion has come back (what a
client waits for). Peak memory: the largest resident set of the server's whole process tree (front end, engine core
and tokenmill's fork server), sampled every 20 ms until then (PSS every 200 ms and at the end), summed two ways: RSS
(a page shared by two processes, such as torch's libraries or the model file's mapped pages, counts twice) and PSS
(each shared page split between the processes that map it: what the tree costs the machine). KV pools: tokenmill's
default 1 GB (mapped, its pages resident as tokens fill them); llama-server 16 slots x 4,096 tokens
(`../shared/peers/llamacpp.sh`'s defaults). Models: the bundled SmolLM2 and every file that `python -m
tests.real_models` fetched. `python benchmarks/bench_load.py` prints the table and writes the "load" section of
docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from tokenmill.bench.report import machine_description, markdown_table, write_section
from tokenmill.bench.server_process import free_port
from tokenmill.model.loader import bundled_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.real_models import DECODER_MODELS, cache_dir  # noqa: E402

PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "tokenmill-peers"))
LLAMA_SERVER = PEERS_DIR / "llama.cpp" / "bin" / "llama-server"
# auto (int8 here), and the file's blocks executed as stored
TOKENMILL_MODES = ("auto", "gguf")


# Reading PSS walks every mapping of every process (~5 ms of CPU for tokenmill's tree here): sampled every 20 ms
# it would take a quarter of a core from the server being timed, so PSS is read every 10th sample and at the end.
PSS_EVERY = 10


def tree_memory(proc: psutil.Process, with_pss: bool) -> tuple[int, int]:
    """(RSS, PSS) bytes summed over the process and its descendants (PSS 0 unless asked for)."""
    rss = pss = 0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):  # a child that just exited
            if with_pss:
                info = p.memory_full_info()
                rss, pss = rss + info.rss, pss + info.pss
            else:
                rss += p.memory_info().rss
    return rss, pss


def start_to_ready(command: list[str], url: str, model_id: str | None) -> tuple[float, float, float]:
    """(seconds to the first completion, peak RSS GB, peak PSS GB of the process tree until then)."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ps = psutil.Process(proc.pid)
    peak_rss = peak_pss = 0
    try:
        for sample in itertools.count():
            rss, pss = tree_memory(ps, with_pss=sample % PSS_EVERY == 0)
            peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
            if proc.poll() is not None:
                raise RuntimeError(f"{command[0]} exited with {proc.returncode}")
            try:
                models = httpx.get(url + "/v1/models", timeout=0.5)
                if models.status_code == 200:
                    model = model_id or models.json()["data"][0]["id"]
                    reply = httpx.post(url + "/v1/completions", timeout=120, json={
                        "model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 0})
                    if reply.status_code == 200:
                        break
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        ready = time.perf_counter() - start
        rss, pss = tree_memory(ps, with_pss=True)
        return ready, max(peak_rss, rss) / 1e9, max(peak_pss, pss) / 1e9
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def tokenmill_command(model: str, port: int, quantization: str) -> list[str]:
    return [sys.executable, "-m", "tokenmill.cli", "serve", model, "--port", str(port), "--log-level", "warning",
            "--disable-log-stats", "--quantization", quantization]


def llamacpp_command(model: str, port: int) -> list[str]:
    threads = str(os.cpu_count() or 1)
    return [str(LLAMA_SERVER), "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", "16",
            "-c", str(16 * 4096), "-cb", "-t", threads, "-tb", threads, "--no-kv-unified", "--no-webui"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3, help="starts per server and file (median and range)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    files = [bundled_model_path()] + [str(cache_dir() / m.file) for m in DECODER_MODELS
                                      if (cache_dir() / m.file).exists()]
    rows: list[list[object]] = []
    for path in files:
        size = os.path.getsize(path) / 1e9
        results: dict[str, list[tuple[float, float, float]]] = {f"tokenmill -q {mode}": [] for mode in TOKENMILL_MODES}
        results["llama.cpp"] = []
        for _ in range(args.runs):  # alternate the servers: the host drifts between runs
            for mode in TOKENMILL_MODES:
                port = free_port()
                results[f"tokenmill -q {mode}"].append(start_to_ready(tokenmill_command(path, port, mode),
                                                                      f"http://127.0.0.1:{port}", None))
            if LLAMA_SERVER.exists():
                port = free_port()
                results["llama.cpp"].append(start_to_ready(llamacpp_command(path, port),
                                                           f"http://127.0.0.1:{port}", "any"))
        for name, values in results.items():
            if not values:
                continue
            ready = [v[0] for v in values]
            rows.append([Path(path).name, f"{size:.2f}", name, f"{statistics.median(ready):.1f} "
                         f"({min(ready):.1f}-{max(ready):.1f})", f"{statistics.median(v[1] for v in values):.2f}",
                         f"{statistics.median(v[2] for v in values):.2f}"])
            print(rows[-1], flush=True)
    body = "\n".join([
        "## Start to ready and peak memory (`python benchmarks/bench_load.py`)", "",
        f"Machine: {machine_description()}. {__doc__.split(chr(10) + chr(10))[1].strip()} Median (min-max) over "
        f"{args.runs} starts of each, alternating the servers.", "",
        markdown_table(["file", "size GB", "server", "start to first completion s", "peak RSS GB", "peak PSS GB"],
                       rows)])
    if not args.no_write:
        write_section("load", body)
        print("wrote docs/BENCHMARKS.md (load)")


if __name__ == "__main__":
    main()
