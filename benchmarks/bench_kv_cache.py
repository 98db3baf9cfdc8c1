"""KV cache dtypes: tokens a pool holds per GB, and decode speed at long contexts against llama.cpp's KV types.

- Capacity: tokens per GiB of `--kv-cache-memory-gb` for each `--kv-cache-dtype`, from the engine's own sizing,
  on the bundled model and the real files (tests/real_models.py fetches them).
- Decode: the model runner alone (no scheduler, no HTTP), as bench_model.py drives it, on a GGUF file (default
  Qwen2.5-Coder-0.5B-Instruct Q4_K_M, `--quantization auto`): 1 and 8 streams, each with a context of 1k / 4k /
  16k tokens already in the pool, then `--steps` greedy decode steps timed. The context's K/V are written
  straight into the blocks (random values, quantized like any written token in an 8-bit format): a step's time
  does not depend on the values, and 8 x 16k real prompt tokens would take most of an hour to prefill here.
  Dtypes are interleaved, `--repeats` times, so their ratios come from side-by-side runs.
- Prefill at depth: `--prefill-tokens` new prompt tokens of one sequence after each context (and after none),
  in chunks of 512: what an agent turn computes once its history comes from the prefix cache or a KV tier.
- llama.cpp: `llama-batched-bench` (build it beside llamacpp.sh's llama-server:
  `cmake --build ~/.cache/tokenmill-peers/llama.cpp/build --target llama-batched-bench`) on the same file, f16
  and q8_0 K/V (`-ctk/-ctv`, flash attention on, as q8_0 V needs), same contexts: its S_TG column is the same
  quantity (decode tokens/s of B streams at that depth; it prefills the prompts for real).

`python benchmarks/bench_kv_cache.py` prints the tables and writes the "kv_cache" section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.real_models import GEMMA3_270M, QWEN25_CODER_05B, fetch  # noqa: E402
from tokenmill import LLM  # noqa: E402
from tokenmill.bench.machine import memory_bandwidth_gbs  # noqa: E402
from tokenmill.bench.report import machine_description, markdown_table, write_section  # noqa: E402
from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.core.outputs import ScheduledRequest, SchedulerOutput  # noqa: E402
from tokenmill.executor.model_runner import ModelRunner, num_kv_blocks_for  # noqa: E402
from tokenmill.model import kv_quant  # noqa: E402
from tokenmill.model.loader import load_model  # noqa: E402
from tokenmill.model.metadata import bundled_model_path, read_metadata  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "tokenmill-peers"))
BATCHED_BENCH = PEERS_DIR / "llama.cpp" / "build" / "bin" / "llama-batched-bench"
CAPACITY_DTYPES = ["float32", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"]
PREFILL_CHUNK = 512  # prompt tokens a step: the default token budget


def capacity_rows(paths: list[str]) -> list[list[object]]:
    """Tokens per GiB of pool per dtype, as the engine sizes the pool (num_kv_blocks_for)."""
    rows: list[list[object]] = []
    for path in paths:
        config = read_metadata(path).config
        tokens = {d: num_kv_blocks_for(EngineConfig(kv_cache_dtype=d, kv_cache_memory_gb=1.0), config) * 16
                  for d in CAPACITY_DTYPES}
        rows.append([Path(path).name, config.head_dim, *(f"{tokens[d]:,}" for d in CAPACITY_DTYPES),
                     f"{tokens['int8'] / tokens['bfloat16']:.2f}x"])
    return rows


def fill_context(runner: ModelRunner, seed: int = 0) -> None:
    """Every block of every layer holds random K/V (quantized as written in an 8-bit format)."""
    gen = torch.Generator().manual_seed(seed)
    first = runner.kv_caches[0]
    fmt = first.format
    k = torch.randn(first.k.transpose(2, 3).shape, generator=gen)  # [blocks, kv_heads, block, head_dim]
    v = torch.randn(first.v.shape, generator=gen)
    if fmt.scaled:
        k_values, k_scales = kv_quant.quantize(k, fmt)
        v_values, v_scales = kv_quant.quantize(v, fmt)
    for cache in runner.kv_caches:
        if fmt.scaled:
            assert cache.k_scale is not None and cache.v_scale is not None
            cache.k.copy_(k_values.transpose(2, 3))
            cache.v.copy_(v_values)
            cache.k_scale.copy_(k_scales)
            cache.v_scale.copy_(v_scales)
        else:
            cache.k.copy_(k.transpose(2, 3))
            cache.v.copy_(v)


def decode_rate(runner: ModelRunner, streams: int, context: int, steps: int) -> float:
    """Output tokens/s of `steps` greedy decode steps of `streams` sequences whose first `context` tokens are
    in the pool (distinct blocks per sequence)."""
    per_seq = -(-(context + steps + 2) // runner.block_size)
    params = SamplingParams(temperature=0.0)
    prompt = [100] * context
    seqs = [(f"s{i}", list(range(i * per_seq, (i + 1) * per_seq)), [101 + i]) for i in range(streams)]

    def step() -> None:
        plan = [ScheduledRequest(rid, out[-1:], context + len(out) - 1, table, True, params, prompt, out)
                for rid, table, out in seqs]
        result = runner.execute(SchedulerOutput(plan))
        for rid, _, out in seqs:
            out.append(result.sampled_token_ids[rid])

    step()  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return streams * steps / (time.perf_counter() - start)


def prefill_rate(runner: ModelRunner, context: int, new_tokens: int, chunk: int) -> float:
    """Prompt tokens/s of `new_tokens` fed in chunks of `chunk` (the scheduler's token budget) to one sequence whose
    first `context` tokens are in the pool: an agent turn's shape, its history cached, its new tokens computed."""
    params = SamplingParams(temperature=0.0)
    end = context + new_tokens
    prompt = [100 + i % 1000 for i in range(end)]
    table = list(range(-(-(end + 1) // runner.block_size)))
    start = time.perf_counter()
    for at in range(context, end, chunk):
        piece = prompt[at:min(at + chunk, end)]
        plan = ScheduledRequest("p", piece, at, table, at + len(piece) == end, params, prompt, [])
        runner.execute(SchedulerOutput([plan]))
    return new_tokens / (time.perf_counter() - start)


def llama_rates(path: str, contexts: list[int], streams: list[int], ctk: str, steps: int,
                max_tokens: int) -> dict[tuple[int, int], float]:
    """{(context, streams): S_TG tok/s} from llama-batched-bench; points over `max_tokens` prefilled tokens are
    skipped (time)."""
    rates: dict[tuple[int, int], float] = {}
    for context in contexts:
        npl = [b for b in streams if b * context <= max_tokens]
        if not npl:
            continue
        command = [str(BATCHED_BENCH), "-m", path, "-c", str(max(npl) * (context + steps) + 64), "-b", "2048",
                   "-ub", "512", "-npp", str(context), "-ntg", str(steps), "-npl", ",".join(map(str, npl)),
                   "-ctk", ctk, "-ctv", ctk, "-fa", "on", "-t", str(os.cpu_count() or 1)]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) >= 8 and re.fullmatch(r"\d+", cells[0] or "x"):
                rates[(int(cells[0]), int(cells[2]))] = float(cells[7])
        print(f"llama.cpp {ctk} context {context}: {[(k, v) for k, v in rates.items() if k[0] == context]}",
              flush=True)
    return rates


FACT = "Note for the records: the access code for the storage room is 7319-KESTREL."
QUESTION = "What is the access code for the storage room? Answer with the code only."


def retrieval(path: str, dtypes: list[str], tokens: int) -> tuple[int, list[list[object]]]:
    """A fact placed after the first paragraph of ~`tokens` tokens of text, asked for at the end (chat template,
    greedy): (prompt tokens, [dtype, answer, right?])."""
    text = (Path(__file__).parent / "data" / "grounded_texts.txt").read_text()
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    rows: list[list[object]] = []
    prompt_tokens = 0
    for dtype in dtypes:
        llm = LLM(path, kv_cache_dtype=dtype, kv_cache_memory_gb=2.0, enable_prefix_caching=False)
        body = [paragraphs[0], FACT]
        while len(llm.tokenizer.encode("\n\n".join(body))) < tokens:
            body += paragraphs[1:]
        message = "\n\n".join(body) + "\n\n" + QUESTION
        output = llm.chat([{"role": "user", "content": message}], SamplingParams(temperature=0.0, max_tokens=12))[0]
        prompt_tokens = len(output.prompt_token_ids)
        answer = output.outputs[0].text.strip()
        rows.append([dtype, f"`{answer}`", "yes" if "7319" in answer else "no"])
        print(rows[-1], flush=True)
        del llm
    return prompt_tokens, rows


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="GGUF file (default: Qwen2.5-Coder-0.5B-Instruct Q4_K_M)")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "int8", "fp8_e4m3"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llama-max-tokens", type=int, default=40000,
                        help="llama.cpp points whose streams x context exceed this are skipped (prefill time)")
    parser.add_argument("--prefill-tokens", type=int, default=1024,
                        help="new prompt tokens after each context (0: skip the prefill table)")
    parser.add_argument("--no-llama", action="store_true")
    parser.add_argument("--retrieval-tokens", type=int, default=16000, help="0: skip the long-context retrieval")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    path = args.model or str(fetch(QWEN25_CODER_05B))
    capacity = capacity_rows([bundled_model_path(), str(fetch(QWEN25_CODER_05B)), str(fetch(GEMMA3_270M))])
    print(capacity, flush=True)
    bandwidth = memory_bandwidth_gbs()
    loaded = load_model(path)
    # every stream's decode, and one sequence's prefill after the longest context
    blocks = max(max(args.streams) * -(-(max(args.contexts) + args.steps + 2) // 16),
                 -(-(max(args.contexts) + args.prefill_tokens + 1) // 16))
    runners = {}
    for dtype in args.dtypes:
        runners[dtype] = ModelRunner(EngineConfig(model=path, kv_cache_dtype=dtype, num_kv_blocks=blocks),
                                     loaded.config, loaded.weights)
        fill_context(runners[dtype])
    quantization = next(iter(runners.values())).quantization
    rates: dict[tuple[int, int, str], list[float]] = {}
    for context in args.contexts:
        for streams in args.streams:
            for _ in range(args.repeats):
                for dtype, runner in runners.items():
                    rate = decode_rate(runner, streams, context, args.steps)
                    rates.setdefault((context, streams, dtype), []).append(rate)
            print(context, streams, {d: spread(rates[(context, streams, d)]) for d in args.dtypes}, flush=True)
    prefill: dict[tuple[int, str], list[float]] = {}
    if args.prefill_tokens:
        prefill_rate(next(iter(runners.values())), 0, 64, 512)  # warm-up
        for context in [0, *args.contexts]:
            for _ in range(args.repeats):
                for dtype, runner in runners.items():
                    rate = prefill_rate(runner, context, args.prefill_tokens, PREFILL_CHUNK)
                    prefill.setdefault((context, dtype), []).append(rate)
            print("prefill after", context, {d: spread(prefill[(context, d)]) for d in args.dtypes}, flush=True)
    llama: dict[str, dict[tuple[int, int], float]] = {}
    if not args.no_llama and BATCHED_BENCH.exists():
        for ctk in ("f16", "q8_0"):
            llama[ctk] = llama_rates(path, args.contexts, args.streams, ctk, args.steps, args.llama_max_tokens)
    retrieval_rows: list[list[object]] = []
    if args.retrieval_tokens:
        runners.clear()  # their pools are the decode measurement's; the retrieval's engines have their own
        prompt_tokens, retrieval_rows = retrieval(path, args.dtypes, args.retrieval_tokens)
    headers = ["context", "streams", *(f"{d} KV tok/s" for d in args.dtypes), "int8 / bf16",
               *(f"llama.cpp {k} KV tok/s" for k in llama), *(["int8 / llama q8_0"] if "q8_0" in llama else [])]
    rows: list[list[object]] = []
    for context in args.contexts:
        for streams in args.streams:
            medians = {d: statistics.median(rates[(context, streams, d)]) for d in args.dtypes}
            row: list[object] = [context, streams, *(spread(rates[(context, streams, d)]) for d in args.dtypes)]
            row.append(f"{medians['int8'] / medians['bfloat16']:.2f}x"
                       if {"int8", "bfloat16"} <= medians.keys() else "-")
            for ctk in llama:
                value = llama[ctk].get((context, streams))
                row.append("-" if value is None else f"{value:.1f}")
            if "q8_0" in llama:
                value = llama["q8_0"].get((context, streams))
                row.append("-" if value is None or "int8" not in medians else f"{medians['int8'] / value:.2f}x")
            rows.append(row)
    prefill_rows: list[list[object]] = []
    for context in [0, *args.contexts] if prefill else []:
        medians = {d: statistics.median(prefill[(context, d)]) for d in args.dtypes}
        ratio = f"{medians['int8'] / medians['bfloat16']:.2f}x" if {"int8", "bfloat16"} <= medians.keys() else "-"
        prefill_rows.append([context, *(spread(prefill[(context, d)]) for d in args.dtypes), ratio])
    text = "\n".join([
        "## KV cache dtypes (`python benchmarks/bench_kv_cache.py`)",
        "",
        f"Machine: {machine_description()}; memory copy bandwidth measured in the same run: {bandwidth:.1f} GB/s.",
        "",
        "Tokens a pool holds per GiB (`--kv-cache-memory-gb 1`, as the engine sizes it; 8-bit formats carry a "
        "bf16 scale per token and KV head):",
        "",
        markdown_table(["model", "head_dim", *CAPACITY_DTYPES, "int8 / bf16"], capacity),
        "",
        f"Decode tok/s on {Path(path).name} (linear layers `{quantization}`), the model runner alone: each stream "
        f"has the context already in the pool (written straight into its blocks), then {args.steps} greedy steps "
        f"timed; median (min-max) of {args.repeats} runs, the dtypes interleaved. llama.cpp: "
        "`llama-batched-bench` S_TG (decode tok/s of B streams at that depth, prompts prefilled for real, "
        f"flash attention on) with `-ctk/-ctv f16` and `q8_0`, one run; points over {args.llama_max_tokens:,} "
        "prompt tokens skipped (prefill time).",
        "",
        markdown_table(headers, rows),
        *(["", f"Prefill tok/s of {args.prefill_tokens:,} new prompt tokens after a context already in the pool (one "
            f"sequence, chunks of {PREFILL_CHUNK} as the token budget feeds them: an agent turn's shape, its history "
            f"cached); median (min-max) of {args.repeats} runs, the dtypes interleaved:", "",
            markdown_table(["context", *(f"{d} KV tok/s" for d in args.dtypes), "int8 / bf16"], prefill_rows)]
           if prefill_rows else []),
        *(["", f"Long context: a fact placed after the first paragraph of a {prompt_tokens:,}-token chat prompt "
            f"(benchmarks/data/grounded_texts.txt repeated), asked for at the end; greedy answers:", "",
            markdown_table(["KV dtype", "answer", "right"], retrieval_rows)] if retrieval_rows else []),
    ])
    print(text)
    if not args.no_write:
        write_section("kv_cache", text)


if __name__ == "__main__":
    main()
