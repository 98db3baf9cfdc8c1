"""Model-execution benchmark: single-sequence decode speed and decode throughput at batch 1/8/32/64.

Drives the paged model runner directly (no scheduler) so the numbers are the model step itself:
`python benchmarks/bench_model.py` prints a table and writes the "model" section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenmill.bench.report import machine_description, markdown_table, write_section
from tokenmill.config import EngineConfig
from tokenmill.core.outputs import ScheduledRequest, SchedulerOutput
from tokenmill.executor.model_runner import ModelRunner
from tokenmill.model.loader import load_model
from tokenmill.sampling_params import SamplingParams


def decode_throughput(runner: ModelRunner, batch: int, prompt_len: int, steps: int) -> tuple[float, float]:
    """(output tokens/s, seconds per step) over `steps` decode steps of `batch` sequences."""
    bs = runner.block_size
    blocks_per_seq = -(-(prompt_len + steps + 1) // bs)
    params = SamplingParams(temperature=0.0)
    seqs = []
    for i in range(batch):
        table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        prompt = [(7 * i + j) % 1000 + 100 for j in range(prompt_len)]
        seqs.append((f"r{i}", table, prompt, []))
    # prefill, in chunks of 8 sequences
    for k in range(0, batch, 8):
        plan = [ScheduledRequest(rid, prompt, 0, table, True, params, prompt, out)
                for rid, table, prompt, out in seqs[k:k + 8]]
        result = runner.execute(SchedulerOutput(plan))
        for rid, _, _, out in seqs[k:k + 8]:
            out.append(result.sampled_token_ids[rid])
    start = time.perf_counter()
    for _ in range(steps):
        plan = [ScheduledRequest(rid, out[-1:], prompt_len + len(out) - 1, table, True, params, prompt, out)
                for rid, table, prompt, out in seqs]
        result = runner.execute(SchedulerOutput(plan))
        for rid, _, _, out in seqs:
            out.append(result.sampled_token_ids[rid])
    elapsed = time.perf_counter() - start
    return batch * steps / elapsed, elapsed / steps


def prefill_throughput(runner: ModelRunner, prompt_len: int, repeats: int = 2) -> float:
    """Prompt tokens/s for one sequence's whole prompt in one step."""
    bs = runner.block_size
    table = list(range(-(-prompt_len // bs)))
    prompt = [(j * 13) % 1000 + 100 for j in range(prompt_len)]
    plan = SchedulerOutput([ScheduledRequest("p", prompt, 0, table, True, SamplingParams(temperature=0.0), prompt, [])])
    runner.execute(plan)
    start = time.perf_counter()
    for _ in range(repeats):
        runner.execute(plan)
    return prompt_len * repeats / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    loaded = load_model(None)
    max_batch = max(args.batches)
    blocks = max(max_batch * (-(-(args.prompt_len + args.steps + 1) // 16)), 2048 // 16) + 1
    runner = ModelRunner(EngineConfig(device=args.device, num_kv_blocks=blocks), loaded.config, loaded.weights)
    decode_throughput(runner, 1, 16, 4)  # warm-up
    rows = []
    for batch in args.batches:
        tps, step = decode_throughput(runner, batch, args.prompt_len, args.steps)
        rows.append([batch, round(tps, 1), round(step * 1000, 1)])
        print(f"batch {batch:3d}: {tps:8.1f} output tokens/s, {step * 1000:7.1f} ms/step", flush=True)
    prefill_rows = []
    for length in (128, 512, 2048):
        tps = prefill_throughput(runner, length)
        prefill_rows.append([length, round(tps, 1)])
        print(f"prefill {length:5d} tokens: {tps:8.1f} prompt tokens/s", flush=True)
    single = rows[0][1] if rows[0][0] == 1 else None
    body = "\n".join([
        "## Model execution (`python benchmarks/bench_model.py`)",
        "",
        f"Machine: {machine_description()}. Model: bundled SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to "
        f"float32), device {args.device}. Each sequence has a {args.prompt_len}-token prompt, then "
        f"{args.steps} greedy decode steps are timed (one token per sequence per step, paged KV, block 16).",
        "",
        f"Single-sequence decode: **{single} tokens/s**." if single else "",
        "",
        markdown_table(["batch", "output tokens/s", "ms/step"], rows),
        "",
        "Prefill (one prompt in one step):",
        "",
        markdown_table(["prompt tokens", "prompt tokens/s"], prefill_rows),
    ])
    if not args.no_write:
        write_section("model", body)
        print("wrote docs/BENCHMARKS.md (model)")
    torch.set_num_threads(torch.get_num_threads())


if __name__ == "__main__":
    main()
