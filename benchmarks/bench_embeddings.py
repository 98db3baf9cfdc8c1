"""Embeddings per second: `tokenmill serve MODEL --task embed` against llama-server `--embeddings` on the same
GGUF file, one server at a time, through their OpenAI `/v1/embeddings` endpoints.

Inputs of 16-512 tokens (uniform; words from tests/data/retrieval_small.json's passages). Workloads: one input
a request, sent one after another (latency); 32 single-input requests at once (batching across requests); one
request of 32 inputs; one request of 256 inputs. Each repeated; the table gives the median embeddings/s and the
spread (min-max). The two engines' vectors for the same inputs are compared (cosine). The machine's own limits
(bf16 and float32 GEMM GFLOP/s, copy GB/s) are measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_peers import llamacpp_server  # noqa: E402
from tokenmill.bench.machine import gemm_gflops, memory_bandwidth_gbs  # noqa: E402
from tokenmill.bench.report import machine_description, markdown_table, write_section  # noqa: E402
from tokenmill.bench.server_process import live_server  # noqa: E402
from tokenmill.encoder.tokenizer import EncoderTokenizer  # noqa: E402

WORKLOADS = ("1 input x 32, one at a time", "1 input x 32, all at once", "32 inputs a request",
             "256 inputs a request")


def build_inputs(tokenizer: EncoderTokenizer, count: int, seed: int) -> list[str]:
    """`count` texts of 16-512 tokens (with [CLS]/[SEP]), lengths uniform."""
    data = json.loads((Path(__file__).resolve().parents[1] / "tests" / "data" / "retrieval_small.json").read_text())
    words = " ".join(data["passages"]).split()
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        target = rng.randint(16, 512)
        text_words = [rng.choice(words) for _ in range(target)]
        while len(tokenizer.encode(" ".join(text_words))[0]) > target and len(text_words) > 1:
            text_words.pop()
        texts.append(" ".join(text_words))
    return texts


def embed(client: httpx.Client, model: str, texts: list[str]) -> np.ndarray:
    reply = client.post("/v1/embeddings", json={"model": model, "input": texts, "encoding_format": "float"})
    reply.raise_for_status()
    return np.array([d["embedding"] for d in sorted(reply.json()["data"], key=lambda d: d["index"])])


def timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def run_engine(url: str, inputs: dict[str, list[str]], repeats: int) -> tuple[dict[str, list[float]], np.ndarray]:
    """Embeddings/s of each workload, once per repeat; and the vectors of the 32-input request."""
    rates: dict[str, list[float]] = {w: [] for w in WORKLOADS}
    with httpx.Client(base_url=url, timeout=1800) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        vectors = embed(client, model, inputs["32"])  # warm-up, and the vectors compared across engines
        singles = inputs["32"]
        for _ in range(repeats):
            seconds = timed(lambda: [embed(client, model, [t]) for t in singles])
            rates[WORKLOADS[0]].append(len(singles) / seconds)
            with ThreadPoolExecutor(len(singles)) as pool:
                seconds = timed(lambda: list(pool.map(lambda t: embed(client, model, [t]), singles)))
            rates[WORKLOADS[1]].append(len(singles) / seconds)
            rates[WORKLOADS[2]].append(32 / timed(lambda: embed(client, model, inputs["32"])))
            rates[WORKLOADS[3]].append(256 / timed(lambda: embed(client, model, inputs["256"])))
    return rates, vectors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="an encoder GGUF (the issue's: nomic-embed-text-v1.5.f16)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engines", nargs="*", default=["tokenmill", "llama.cpp"])
    parser.add_argument("--llama-batch", type=int, default=512,
                        help="llama-server's -b and -ub (an input must fit one ubatch: >= 512 here); its "
                             "attention spans the whole ubatch, so larger ones cost it more")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    tokenizer = EncoderTokenizer.from_path(args.model)
    inputs = {"32": build_inputs(tokenizer, 32, args.seed), "256": build_inputs(tokenizer, 256, args.seed + 1)}
    tokens = {k: sum(len(tokenizer.encode(t)[0]) for t in v) for k, v in inputs.items()}
    limits = {"bf16 GEMM GFLOP/s": gemm_gflops("bf16"), "float32 GEMM GFLOP/s": gemm_gflops("none"),
              "copy GB/s": memory_bandwidth_gbs()}
    print(", ".join(f"{k} {v:.0f}" for k, v in limits.items()), flush=True)
    results: dict[str, dict[str, list[float]]] = {}
    vectors: dict[str, np.ndarray] = {}
    for engine in args.engines:
        if engine == "tokenmill":
            with live_server("--model", args.model, "--max-num-batched-tokens", "8192", "--max-num-seqs", "256",
                             timeout=600, omp_wait_policy=None) as server:
                results[engine], vectors[engine] = run_engine(server.url, inputs, args.repeats)
        else:  # as many slots as inputs in a request, each holding the longest input; inputs run whole
            flags = ("--embeddings", "--pooling", "mean", "-np", "32", "-c", str(32 * 512), "-b",
                     str(args.llama_batch), "-ub", str(args.llama_batch))
            with llamacpp_server(args.model, flags) as url:
                if url is None:
                    print("llama-server not built (../shared/peers/llamacpp.sh build): skipped")
                    continue
                results[engine], vectors[engine] = run_engine(url, inputs, args.repeats)
        print(engine, {w: [round(r, 1) for r in rates] for w, rates in results[engine].items()}, flush=True)

    rows = []
    for workload in WORKLOADS:
        row: list[object] = [workload]
        for engine in results:
            rates = results[engine][workload]
            row.append(f"{statistics.median(rates):.1f} ({min(rates):.1f}-{max(rates):.1f})")
        if len(results) == 2:
            first, second = (statistics.median(results[e][workload]) for e in results)
            row.append(f"{first / second:.2f}x")
        rows.append(row)
    headers = ["workload", *(f"{e} embeddings/s" for e in results)] + (["ratio"] if len(results) == 2 else [])
    lines = [f"Machine: {machine_description()}; {', '.join(f'{k} {v:.0f}' for k, v in limits.items())}. "
             f"File: {Path(args.model).name}. Inputs of 16-512 tokens: 32 of them {tokens['32']} tokens, 256 "
             f"{tokens['256']}. tokenmill serve --task embed (bf16 linears where the CPU has them, "
             f"--max-num-batched-tokens 8192); llama-server --embeddings --pooling mean -np 32 -b {args.llama_batch} "
             f"-ub {args.llama_batch}, "
             f"{args.repeats} repeats each, one server at a time. Median (min-max).", "",
             markdown_table(headers, rows)]
    if len(vectors) == 2:
        a, b = vectors.values()
        cosine = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        lines += ["", f"- cosine of the two engines' embeddings of the same 32 inputs: min {cosine.min():.6f}, "
                      f"mean {cosine.mean():.6f}"]
    report = "\n".join(lines)
    print(report)
    Path("/tmp/bench_embeddings.json").write_text(json.dumps({"results": results, "limits": limits}, indent=1))
    if not args.no_write:
        write_section("embeddings", "## Embeddings (`python benchmarks/bench_embeddings.py`)\n\n" + report)


if __name__ == "__main__":
    main()
