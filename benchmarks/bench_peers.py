"""tokenmill side by side with the CPU references on the same machine and model file, in one run.

- offline (OpenVINO GenAI's protocol, `../shared/peers/openvino_bench.py`): one greedy stream of 256 tokens
  from "Once upon a time, in a village by the sea," and the 32 prompts of `../shared/peers/prompts32.json`
  submitted together, 128 tokens each, EOS ignored; median of 3. tokenmill runs its `LLM` with the same
  prompts and settings, prefix caching off as in OpenVINO's run (the repeats send the same prompts); OpenVINO
  GenAI runs when `../shared/peers/openvino.sh setup` was done. `--runs` alternates the engines.
- serving: `tokenmill serve` (no flags: the default fast path) and llama.cpp's `llama-server` (when
  `../shared/peers/llamacpp.sh build` was done), each driven by `tokenmill bench serve`'s load generator: one
  stream (32-token prompt, 256 output tokens, EOS ignored; a fresh prompt each repeat), 32 `mixed` requests at
  once, and the worst stall
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
import torch

from tokenmill.bench import workloads
from tokenmill.bench.loadgen import run_load
from tokenmill.bench.offline import OfflineRates, peer_protocol_llm, peer_protocol_rates
from tokenmill.bench.report import machine_description, markdown_table, write_section
from tokenmill.bench.server_process import free_port, live_server
from tokenmill.bench.stats import summarize
from tokenmill.bench.sweep_scenarios import worst_gap_during_long_prefill
from tokenmill.model.loader import resolve_model_path
from tokenmill.model.tokenizer import Tokenizer
from tokenmill.platform import isa_level

PEERS = Path(__file__).resolve().parents[2] / "shared" / "peers"
PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "tokenmill-peers"))
STORY = "Once upon a time, in a village by the sea,"


def offline_tokenmill(quantization: str, prompts: list[str], repeats: int = 3) -> OfflineRates:
    """The peers' offline protocol on tokenmill's `LLM`, prefix caching off and 2 threads as in OpenVINO GenAI's
    run (openvino_bench.py sets INFERENCE_NUM_THREADS 2)."""
    torch.set_num_threads(2)
    rates = peer_protocol_rates(peer_protocol_llm(quantization), STORY, prompts, repeats)
    assert rates.prefix_hit_tokens == 0, "a repeat was served from the prefix cache"
    return rates


def offline_openvino(fmt: str) -> tuple[float, float] | None:
    if not (PEERS_DIR / f"ov-{fmt}").is_dir():
        return None
    out = subprocess.run(["bash", str(PEERS / "openvino.sh"), "bench", fmt], capture_output=True, text=True)
    found = re.search(r"single stream ([\d.]+) tok/s; \d+ prompts x 128: ([\d.]+) output tok/s", out.stdout)
    if not found:
        print(out.stdout[-2000:], out.stderr[-2000:])
        return None
    return float(found.group(1)), float(found.group(2))


# llama-server set up as tokenmill serves: 32 slots, so each of the 32 `mixed` requests runs at once (tokenmill
# admits up to 64), and 512 prompt tokens a step (-b/-ub; tokenmill's max_num_batched_tokens): with
# llamacpp.sh's -b 2048 a long prompt holds the other slots for 2,048 tokens, four of tokenmill's chunks.
LLAMACPP_SLOTS, LLAMACPP_BATCH, LLAMACPP_CTX_PER_SLOT = 32, 512, 4096


def llamacpp_isa() -> str:
    """The instruction sets the llama-server under PEERS_DIR was built for (its CMake cache), for the report."""
    cache = PEERS_DIR / "llama.cpp" / "build" / "CMakeCache.txt"
    if not cache.exists():
        return "unknown"
    flags = re.findall(r"^GGML_(NATIVE|AVX\w*|AMX\w*|FMA|F16C):BOOL=(ON|OFF)$", cache.read_text(), re.MULTILINE)
    if ("NATIVE", "ON") in flags:
        return "-march=native (GGML_NATIVE=ON)"
    return " ".join(name for name, value in flags if value == "ON") or "generic"


def isa_note() -> str:
    """Which kernels each engine ran, for the report: tokenmill's level, llama-server's build."""
    level = isa_level()
    ours = f"tokenmill's kernels for {level} (TOKENMILL_ISA={level})" if level else "tokenmill's kernels for this CPU"
    return f"{ours}; llama-server built for {llamacpp_isa()} ({PEERS_DIR})."


def section_name(base: str) -> str:
    level = isa_level()
    return base if level is None else f"{base}-{level}"


@contextmanager
def llamacpp_server(model: str | None = None, extra: tuple[str, ...] = ()) -> Iterator[str | None]:
    """llama-server on `model` (default: llamacpp.sh's copy of the bundled file); `extra`: more flags."""
    binary = PEERS_DIR / "llama.cpp" / "bin" / "llama-server"
    if not binary.exists():
        yield None
        return
    port = free_port()
    threads = str(os.cpu_count() or 1)
    # llamacpp.sh's `serve` command line, with the slots and step size above
    model = model or str(PEERS_DIR / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    command = [str(binary), "-m", model, "--host",
               "127.0.0.1", "--port", str(port), "--alias", "smollm2", "-np", str(LLAMACPP_SLOTS),
               "-c", str(LLAMACPP_SLOTS * LLAMACPP_CTX_PER_SLOT), "-cb", "-t", threads, "-tb", threads,
               "-b", str(LLAMACPP_BATCH), "-ub", str(LLAMACPP_BATCH), "--no-kv-unified", "--no-webui", *extra]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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


def single_streams(url: str, model: str, tokenizer: Tokenizer, repeats: int) -> list[float]:
    """Output tok/s of one stream of 256 tokens after a 32-token prompt, `repeats` times with a fresh prompt each
    (neither server's prompt cache answers a repeat), after one short warm-up request."""
    asyncio.run(run_load(url, model, workloads.random_lengths(tokenizer, 1, 32, 16, seed=9)))
    rates = []
    for repeat in range(repeats):
        items = workloads.random_lengths(tokenizer, 1, input_len=32, output_len=256, seed=100 + repeat)
        results, duration = asyncio.run(run_load(url, model, items))
        rates.append(summarize(results, duration)["output_throughput"])
    return rates


def serve_runs(url: str, model: str, tokenizer: Tokenizer, repeats: int = 3) -> dict[str, Any]:
    """Single stream (median of `repeats`, a fresh prompt each time, so neither server's prompt cache answers a
    repeat) and 32 mixed requests at once, through the same load generator."""
    singles = single_streams(url, model, tokenizer, repeats)
    mixed_items = workloads.mixed(tokenizer, 32, seed=0)
    results, duration = asyncio.run(run_load(url, model, mixed_items))
    # short streams long enough to still be decoding when the long prompt arrives, on a fast engine too
    long_prompt = workloads.long_interference(tokenizer, seed=0, short_output=1024, long_arrival=2.0)
    interference, _ = asyncio.run(run_load(url, model, long_prompt))
    return {"single": singles, "mixed": summarize(results, duration),
            "stall": worst_gap_during_long_prefill(interference)}


def served_model(url: str) -> str:
    return str(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])


def prompt_rate(url: str, model: str, tokenizer: Tokenizer, prompt_len: int, repeats: int = 3) -> list[float]:
    """Prompt tokens per second of one request alone (prompt_len / its TTFT; one output token), fresh prompts."""
    rates = []
    for repeat in range(repeats):
        items = workloads.random_lengths(tokenizer, 1, input_len=prompt_len, output_len=1, seed=500 + repeat)
        results, _ = asyncio.run(run_load(url, model, items))
        rates.append(results[0].prompt_tokens / results[0].ttft)
    return rates


def model_runs(url: str, tokenizer: Tokenizer, repeats: int = 3) -> dict[str, Any]:
    """The rows of issue 25's table for one server on one model file."""
    model = served_model(url)
    singles = single_streams(url, model, tokenizer, repeats)
    out: dict[str, Any] = {"single": singles, "prompt512": prompt_rate(url, model, tokenizer, 512, repeats),
                           "prompt2048": prompt_rate(url, model, tokenizer, 2048, repeats)}
    for concurrency in (16, 32):
        results, duration = asyncio.run(run_load(url, model, workloads.mixed(tokenizer, concurrency, seed=0)))
        out[f"mixed{concurrency}"] = summarize(results, duration)
    return out


def streamed_bytes_per_token(path: str) -> dict[str, float]:
    """Weight bytes one decode step reads, per way of running the file: every 2-D weight once (the embedding
    table only where it is also the LM head), as the file stores it (`gguf`, llama.cpp) and as int8 rows."""
    from tokenmill.model.gguf_file import GGUFFile

    reader = GGUFFile(path)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    stored = int8 = 0
    for tensor in reader.tensors:
        if len(tensor.shape) != 2 or (tensor.name == "token_embd.weight" and not tied):
            continue
        stored += tensor.data.nbytes
        int8 += tensor.shape[0] * tensor.shape[1] + 4 * tensor.shape[1]  # int8 values + a float32 scale a row
    return {"stored": stored, "int8": int8}


def model_section(path: str, modes: list[str], runs: int, omp_wait_policy: str | None) -> list[str]:
    """tokenmill serve (each of `modes`) and llama-server on one GGUF file, one after the other."""
    from tokenmill.bench.machine import memory_bandwidth_gbs

    tokenizer = Tokenizer.from_path(path)
    bandwidth = memory_bandwidth_gbs()
    per_token = streamed_bytes_per_token(path)
    results: dict[str, dict[str, Any]] = {}
    for mode in modes:
        with live_server("--model", path, "--quantization", mode, omp_wait_policy=omp_wait_policy) as server:
            results[f"tokenmill -q {mode}"] = model_runs(server.url, tokenizer, runs)
        print(mode, results[f"tokenmill -q {mode}"]["single"], flush=True)
    with llamacpp_server(path) as url:
        if url:
            results["llama.cpp"] = model_runs(url, tokenizer, runs)
    peer = results.get("llama.cpp")
    rows: list[list[object]] = []
    from tokenmill.model.quant import resolve_quantization

    for name, r in results.items():
        mode = name.removeprefix("tokenmill -q ")  # the server resolves `auto` as this does
        streamed = per_token["int8" if mode != name and resolve_quantization(mode, "cpu", True) == "int8"
                             else "stored"]
        gbs = statistics.median(r["single"]) * streamed / 1e9
        rows.append([name, spread(r["single"]), f"{gbs:.1f} ({gbs / bandwidth:.0%})", spread(r["prompt512"], 0),
                     spread(r["prompt2048"], 0), *[mixed_cell(r[f"mixed{c}"]) for c in (16, 32)]])
        print(rows[-1], flush=True)
        if peer is not None and r is not peer:
            rows.append([f"{name} / llama.cpp", median_ratio(r["single"], peer["single"]), "",
                         median_ratio(r["prompt512"], peer["prompt512"]),
                         median_ratio(r["prompt2048"], peer["prompt2048"]),
                         *[median_ratio([r[f"mixed{c}"]["total_token_throughput"]],
                                        [peer[f"mixed{c}"]["total_token_throughput"]]) for c in (16, 32)]])
    return [f"### {Path(path).name} ({os.path.getsize(path) / 1e9:.2f} GB)", "",
            f"Memory {bandwidth:.1f} GB/s (copy, measured in this run). Weight bytes a decode step reads: "
            f"{per_token['stored'] / 1e9:.2f} GB as the file stores them (llama.cpp, `-q gguf`), "
            f"{per_token['int8'] / 1e9:.2f} GB as int8 rows (`-q int8`; `-q auto` is "
            f"`{resolve_quantization('auto', 'cpu', True)}` here). Single stream: 256 tokens after a "
            "32-token prompt, EOS ignored, median (min-max) of 3 fresh prompts; the next column is those bytes x "
            "tok/s (share of the copy bandwidth). Prompt tok/s: one request alone, prompt / TTFT, median of 3. "
            "`mixed` (prompts 32-512, outputs 8-512) with all requests at once: total tok/s / TTFT p50 s / ITL p50 ms.",
            "",
            markdown_table(["server", "single stream tok/s", "GB/s streamed", "prompt 512 tok/s",
                            "prompt 2048 tok/s", "16 mixed", "32 mixed"], rows), ""]


def mixed_cell(summary: dict[str, Any]) -> str:
    return (f"{summary['total_token_throughput']:.1f} / {summary['ttft_s']['p50']:.2f} / "
            f"{summary['itl_s']['p50'] * 1000:.0f}")


def median_ratio(ours: list[float], theirs: list[float]) -> str:
    return f"{statistics.median(ours) / statistics.median(theirs):.2f}x"


def spread(values: list[float], digits: int = 1) -> str:
    """"median (min-max)" of repeated measurements."""
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def offline_section(quantization: str, prompts: list[str], runs: int) -> list[str]:
    """tokenmill and OpenVINO GenAI alternated `runs` times on the same protocol; each run's ratio is taken
    between neighbouring measurements, so the host's drift between runs does not enter it."""
    ours: list[OfflineRates] = []
    peers: dict[str, list[tuple[float, float]]] = {"int8": [], "int4": []}
    for run in range(runs):
        ours.append(offline_tokenmill(quantization, prompts))
        print(f"run {run}: tokenmill {quantization}: single {ours[-1].single}, 32x128 {ours[-1].batch}", flush=True)
        for fmt, results in peers.items():
            peer = offline_openvino(fmt)
            print(f"run {run}: openvino {fmt}: {peer}", flush=True)
            if peer:
                results.append(peer)
    single = [statistics.median(r.single) for r in ours]
    batch = [statistics.median(r.batch) for r in ours]
    rows: list[list[object]] = [[f"tokenmill (`--quantization {quantization}`, prefix caching off)", spread(single),
                                 spread(batch), "", ""]]
    for fmt, results in peers.items():
        if len(results) != runs:
            continue
        rows.append([f"OpenVINO GenAI {fmt} (prefix caching off)", spread([p[0] for p in results]),
                     spread([p[1] for p in results]),
                     spread([s / p[0] for s, p in zip(single, results)], 2),
                     spread([b / p[1] for b, p in zip(batch, results)], 2)])
    return ["Offline (OpenVINO GenAI's protocol, `../shared/peers/openvino_bench.py`, on both sides: one greedy "
            "stream of 256 tokens; 32 prompts of 5-400 tokens x 128 new tokens submitted together; EOS ignored; "
            "2 threads; **prefix caching off** on both, so every repeat prefills its prompts; one warm-up not "
            f"counted; each engine's median of 3 repeats; {runs} runs alternating the engines, shown as median "
            "(min-max) over the runs, ratios taken run by run):", "",
            markdown_table(["engine", "single stream tok/s", "32 prompts x 128: output tok/s",
                            "tokenmill / it (single)", "tokenmill / it (32 prompts)"], rows), ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quantization", default="auto", help="tokenmill's mode for the offline runs")
    parser.add_argument("--omp-wait-policy", default=os.environ.get("OMP_WAIT_POLICY", ""),
                        help="OMP_WAIT_POLICY for `tokenmill serve` (empty: libgomp's default)")
    parser.add_argument("--runs", type=int, default=3,
                        help="offline: alternate tokenmill and each OpenVINO format this many times (ratio spread)")
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-serve", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--model", default=None,
                        help="a GGUF file: serve it with tokenmill (each --serve-quantization) and llama-server, "
                             "and write the section peers-model (instead of the bundled model's offline/serving)")
    parser.add_argument("--serve-quantization", nargs="+", default=["auto", "gguf"],
                        help="with --model: tokenmill serve's --quantization modes to measure")
    args = parser.parse_args()
    if args.model is not None:
        lines = ["## Real model files, side by side with llama.cpp (`python benchmarks/bench_peers.py --model FILE`)",
                 "", f"Machine: {machine_description()}. Each server alone, one after the other, in one run; "
                 "llama-server with 32 slots and -b/-ub 512 (tokenmill's step budget).", "",
                 *model_section(args.model, args.serve_quantization, args.runs, args.omp_wait_policy or None)]
        print("\n".join(lines))
        if not args.no_write:
            lines.insert(3, isa_note() + "\n")
            write_section(section_name(f"peers-{Path(args.model).stem}"), "\n".join(lines))
            print(f"wrote docs/BENCHMARKS.md ({section_name(f'peers-{Path(args.model).stem}')})")
        return
    prompts = json.loads((PEERS / "prompts32.json").read_text())
    lines = ["## Side by side with llama.cpp and OpenVINO GenAI (`python benchmarks/bench_peers.py`)", "",
             f"Machine: {machine_description()}. Same model file (SmolLM2-135M-Instruct Q4_1 GGUF) everywhere; "
             "each engine measured alone, one after the other, in one run.", ""]

    if not args.skip_offline:
        lines += offline_section(args.quantization, prompts, args.runs)

    if not args.skip_serve:
        tokenizer = Tokenizer.from_path(resolve_model_path(None))
        with live_server(omp_wait_policy=args.omp_wait_policy or None) as server:
            ours_serve = serve_runs(server.url, "SmolLM2-135M-Instruct", tokenizer)
        with llamacpp_server() as url:
            theirs = serve_runs(url, "smollm2", tokenizer) if url else None
        table = []
        peer_name = f"llama.cpp llama-server ({LLAMACPP_SLOTS} slots, -b/-ub {LLAMACPP_BATCH})"
        for name, result in (("tokenmill serve", ours_serve), (peer_name, theirs)):
            if result is None:
                continue
            single, mixed = result["single"], result["mixed"]
            table.append([name, spread(single), round(mixed["total_token_throughput"], 1),
                          round(mixed["output_throughput"], 1), round(mixed["itl_s"]["p50"] * 1000, 1),
                          round(mixed["ttft_s"]["p50"], 2), round(result["stall"], 2)])
            print(name, table[-1], flush=True)
        if theirs:
            ratio_single = statistics.median(ours_serve["single"]) / statistics.median(theirs["single"])
            ratio_mixed = ours_serve["mixed"]["total_token_throughput"] / theirs["mixed"]["total_token_throughput"]
            table.append(["tokenmill / llama.cpp", f"{ratio_single:.2f}", f"{ratio_mixed:.2f}", "", "", "",
                          f"{ours_serve['stall'] / theirs['stall']:.2f}"])
        policy = args.omp_wait_policy or "libgomp's default"
        lines += ["Serving over loopback with `tokenmill bench serve`'s load generator (tokenmill with "
                  f"OMP_WAIT_POLICY {policy}; prefix caching on in both, as each serves by default, with no prompt "
                  "repeated): one stream of 256 tokens after a 32-token prompt (median (min-max) of 3, a fresh "
                  "prompt each), "
                  "and 32 `mixed` requests at once (prompts 32-512, outputs 8-512 heavy-tailed, EOS ignored); last "
                  "column: `long-interference`, the longest stall of 4 short streams (1,024 tokens each) while a "
                  "3,000-token prompt arrives 2 s later and is prefilled (both 512 prompt tokens a step: tokenmill's "
                  "default chunked prefill, llama.cpp's -b/-ub 512).", "",
                  markdown_table(["server", "single stream tok/s", "32 mixed: total tok/s", "32 mixed: output tok/s",
                                  "32 mixed: ITL p50 ms", "32 mixed: TTFT p50 s", "worst stall s"], table)]
    if not args.no_write:
        lines.insert(3, isa_note() + "\n")
        write_section(section_name("peers"), "\n".join(lines))
        print(f"wrote docs/BENCHMARKS.md ({section_name('peers')})")


if __name__ == "__main__":
    main()
