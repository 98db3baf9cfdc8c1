"""tokenmill side by side with the CPU references on the same machine and model file, in one run.

- offline (OpenVINO GenAI's protocol, `../shared/peers/openvino_bench.py`): one greedy stream of 256 tokens
  from "Once upon a time, in a village by the sea," and the 32 prompts of `../shared/peers/prompts32.json`
  submitted together, 128 tokens each, EOS ignored; median of 3. tokenmill runs its `LLM` with the same
  prompts and settings; OpenVINO GenAI runs when `../shared/peers/openvino.sh setup` was done.
- serving: `tokenmill serve` (no flags: the default fast path) and llama.cpp's `llama-server` (when
  `../shared/peers/llamacpp.sh build` was done), each driven by `tokenmill bench serve`'s load generator: one
  stream (32-token prompt, 256 output tokens, EOS ignored), 32 `mixed` requests at once, and the worst stall
  of short streams while a 3,000-token prompt arrives (`long-interference`).

`python benchmarks/bench_peers.py` prints the tables and writes the "peers" section of docs/BENCHMARKS.md.
Run it on an idle machine: the servers are measured one after the other, never side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tokenmill import LLM, SamplingParams
from tokenmill.bench import workloads
from tokenmill.bench.loadgen import run_load
from tokenmill.bench.report import machine_description, markdown_table, write_section
from tokenmill.bench.server_process import free_port, live_server
from tokenmill.bench.stats import summarize
from tokenmill.bench.sweep import worst_gap_during_long_prefill
from tokenmill.model.loader import resolve_model_path
from tokenmill.model.tokenizer import Tokenizer

PEERS = Path(__file__).resolve().parents[2] / "shared" / "peers"
PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "tokenmill-peers"))
STORY = "Once upon a time, in a village by the sea,"


def offline_tokenmill(quantization: str, prompts: list[str], repeats: int = 3) -> tuple[float, float]:
    """(single-stream tok/s, 32-prompt output tok/s), medians of `repeats`."""
    llm = LLM(quantization=quantization, max_num_seqs=64)
    llm.generate([STORY], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))  # warm-up

    def rate(batch: list[str], tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(batch, params)
        return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)

    single = statistics.median(rate([STORY], 256) for _ in range(repeats))
    batch = statistics.median(rate(prompts, 128) for _ in range(repeats))
    return single, batch


def offline_openvino(fmt: str) -> tuple[float, float] | None:
    if not (PEERS_DIR / f"ov-{fmt}").is_dir():
        return None
    out = subprocess.run(["bash", str(PEERS / "openvino.sh"), "bench", fmt], capture_output=True, text=True)
    found = re.search(r"single stream ([\d.]+) tok/s; \d+ prompts x 128: ([\d.]+) output tok/s", out.stdout)
    if not found:
        print(out.stdout[-2000:], out.stderr[-2000:])
        return None
    return float(found.group(1)), float(found.group(2))


@contextmanager
def llamacpp_server() -> Iterator[str | None]:
    if not (PEERS_DIR / "llama.cpp" / "bin" / "llama-server").exists():
        yield None
        return
    port = free_port()
    proc = subprocess.Popen(["bash", str(PEERS / "llamacpp.sh"), "serve", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def serve_runs(url: str, model: str, tokenizer: Tokenizer) -> dict[str, dict[str, Any]]:
    """Single stream (best of 3) and 32 mixed requests at once, through the same load generator."""
    single_items = workloads.random_lengths(tokenizer, 1, input_len=32, output_len=256)
    asyncio.run(run_load(url, model, workloads.random_lengths(tokenizer, 1, 32, 16, seed=9)))  # warm-up
    singles = []
    for _ in range(3):
        results, duration = asyncio.run(run_load(url, model, single_items))
        singles.append(summarize(results, duration))
    single = max(singles, key=lambda s: s["output_throughput"])
    mixed_items = workloads.mixed(tokenizer, 32, seed=0)
    results, duration = asyncio.run(run_load(url, model, mixed_items))
    # short streams long enough to still be decoding when the long prompt arrives, on a fast engine too
    long_prompt = workloads.long_interference(tokenizer, seed=0, short_output=1024, long_arrival=2.0)
    interference, _ = asyncio.run(run_load(url, model, long_prompt))
    return {"single": single, "mixed": summarize(results, duration),
            "stall": worst_gap_during_long_prefill(interference)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quantization", default="auto", help="tokenmill's mode for the offline runs")
    parser.add_argument("--omp-wait-policy", default=os.environ.get("OMP_WAIT_POLICY", ""),
                        help="OMP_WAIT_POLICY for `tokenmill serve` (empty: libgomp's default)")
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-serve", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    prompts = json.loads((PEERS / "prompts32.json").read_text())
    lines = ["## Side by side with llama.cpp and OpenVINO GenAI (`python benchmarks/bench_peers.py`)", "",
             f"Machine: {machine_description()}. Same model file (SmolLM2-135M-Instruct Q4_1 GGUF) everywhere; "
             "each engine measured alone, one after the other, in one run.", ""]

    if not args.skip_offline:
        ours = offline_tokenmill(args.quantization, prompts)
        print(f"tokenmill {args.quantization}: single {ours[0]:.1f} tok/s, 32x128 {ours[1]:.1f} tok/s", flush=True)
        rows: list[list[object]] = [[f"tokenmill (`--quantization {args.quantization}`)", round(ours[0], 1),
                                     round(ours[1], 1), "1.00", "1.00"]]
        for fmt in ("int8", "int4"):
            peer = offline_openvino(fmt)
            print(f"openvino {fmt}: {peer}", flush=True)
            if peer:
                rows.append([f"OpenVINO GenAI {fmt}", peer[0], peer[1], f"{ours[0] / peer[0]:.2f}",
                             f"{ours[1] / peer[1]:.2f}"])
        lines += ["Offline (OpenVINO GenAI's protocol: one greedy stream of 256 tokens; 32 prompts of 5-400 "
                  "tokens x 128 new tokens submitted together; EOS ignored; median of 3):", "",
                  markdown_table(["engine", "single stream tok/s", "32 prompts x 128: output tok/s",
                                  "tokenmill / it (single)", "tokenmill / it (32 prompts)"], rows), ""]

    if not args.skip_serve:
        tokenizer = Tokenizer.from_path(resolve_model_path(None))
        with live_server(omp_wait_policy=args.omp_wait_policy or None) as server:
            ours_serve = serve_runs(server.url, "SmolLM2-135M-Instruct", tokenizer)
        with llamacpp_server() as url:
            theirs = serve_runs(url, "smollm2", tokenizer) if url else None
        table = []
        for name, result in (("tokenmill serve", ours_serve), ("llama.cpp llama-server (16 slots)", theirs)):
            if result is None:
                continue
            single, mixed = result["single"], result["mixed"]
            table.append([name, round(single["output_throughput"], 1), round(mixed["total_token_throughput"], 1),
                          round(mixed["output_throughput"], 1), round(mixed["itl_s"]["p50"] * 1000, 1),
                          round(mixed["ttft_s"]["p50"], 2), round(result["stall"], 2)])
            print(name, table[-1], flush=True)
        if theirs:
            ratio_single = ours_serve["single"]["output_throughput"] / theirs["single"]["output_throughput"]
            ratio_mixed = ours_serve["mixed"]["total_token_throughput"] / theirs["mixed"]["total_token_throughput"]
            table.append(["tokenmill / llama.cpp", f"{ratio_single:.2f}", f"{ratio_mixed:.2f}", "", "", "",
                          f"{ours_serve['stall'] / theirs['stall']:.2f}"])
        policy = args.omp_wait_policy or "libgomp's default"
        lines += ["Serving over loopback with `tokenmill bench serve`'s load generator (tokenmill with "
                  f"OMP_WAIT_POLICY {policy}): one stream of 256 tokens after a 32-token prompt (best of 3), "
                  "and 32 `mixed` requests at once (prompts 32-512, outputs 8-512 heavy-tailed, EOS ignored); last "
                  "column: `long-interference`, the longest stall of 4 short streams (1,024 tokens each) while a "
                  "3,000-token prompt arrives 2 s later and is prefilled (tokenmill with its default chunked prefill, "
                  "512 tokens a step).", "",
                  markdown_table(["server", "single stream tok/s", "32 mixed: total tok/s", "32 mixed: output tok/s",
                                  "32 mixed: ITL p50 ms", "32 mixed: TTFT p50 s", "worst stall s"], table)]
    if not args.no_write:
        write_section("peers", "\n".join(lines))
        print("wrote docs/BENCHMARKS.md (peers)")


if __name__ == "__main__":
    main()
