"""Model-execution benchmark, per execution mode (--quantization none / int8 / bf16).

Drives the paged model runner directly (no scheduler) so the numbers are the model step itself: decode tokens/s
and ms per step at several batch sizes, the share of the step spent in the linear layers (GEMMs), prefill
tokens/s, and peak memory at load. The machine's own limits are measured in the same run (memory GB/s, GEMM
GFLOP/s per mode), so each row also reads as a share of what this machine can do.

`python benchmarks/bench_model.py` prints the tables and writes the "model" section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from tokenmill.bench.machine import gemm_gflops, memory_bandwidth_gbs
from tokenmill.bench.report import machine_description, markdown_table, write_section
from tokenmill.bench.stats import median_seconds
from tokenmill.config import EngineConfig
from tokenmill.core.outputs import ScheduledRequest, SchedulerOutput
from tokenmill.executor.model_runner import ModelRunner
from tokenmill.model.linear import QuantLinear
from tokenmill.model.loader import load_model
from tokenmill.sampling_params import SamplingParams

MODES = ["none", "int8", "bf16"]


def linears_ms(runner: ModelRunner, batch: int) -> float:
    """ms to run every linear of the model (the layers' projections and the LM head) once on `batch` rows."""
    layers = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    inputs = {m.in_features: torch.randn(batch, m.in_features) for m in layers}
    with torch.inference_mode():
        return 1000 * median_seconds(lambda: [m(inputs[m.in_features]) for m in layers], 5)


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
    for k in range(0, batch, 8):  # prefill, 8 sequences a step
        plan = [ScheduledRequest(rid, prompt, 0, table, True, params, prompt, out)
                for rid, table, prompt, out in seqs[k:k + 8]]
        result = runner.execute(SchedulerOutput(plan))
        for rid, _, _, out in seqs[k:k + 8]:
            out.append(result.sampled_token_ids[rid])

    def step() -> None:
        plan = [ScheduledRequest(rid, out[-1:], prompt_len + len(out) - 1, table, True, params, prompt, out)
                for rid, table, prompt, out in seqs]
        result = runner.execute(SchedulerOutput(plan))
        for rid, _, _, out in seqs:
            out.append(result.sampled_token_ids[rid])

    step()  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = time.perf_counter() - start
    return batch * steps / elapsed, elapsed / steps


def prefill_throughput(runner: ModelRunner, prompt_len: int, repeats: int = 2) -> float:
    """Prompt tokens/s for one sequence's whole prompt in one step."""
    table = list(range(-(-prompt_len // runner.block_size)))
    prompt = [(j * 13) % 1000 + 100 for j in range(prompt_len)]
    plan = SchedulerOutput([ScheduledRequest("p", prompt, 0, table, True, SamplingParams(temperature=0.0), prompt, [])])
    return prompt_len / median_seconds(lambda: runner.execute(plan), repeats)


def peak_load_rss_mb(mode: str, materialize: bool = False) -> float:
    """Peak resident memory (MB) of a fresh process that loads the bundled model in `mode` (tiny KV cache).

    `materialize` first reads every weight into one float32 state dict, as the loader did before weights were
    converted one tensor at a time."""
    # VmHWM, not ru_maxrss: a child's ru_maxrss starts from its parent's peak (Linux keeps it across exec).
    code = (
        "import re\n"
        "from tokenmill.config import EngineConfig\n"
        "from tokenmill.executor.model_runner import ModelRunner\n"
        "from tokenmill.model.loader import load_model\n"
        "m = load_model(None)\n"
        f"w = dict(m.weights) if {materialize} else m.weights\n"
        f"ModelRunner(EngineConfig(quantization={mode!r}, num_kv_blocks=4), m.config, w)\n"
        "print(int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) / 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--prefill", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    mem = memory_bandwidth_gbs()
    peaks = {mode: gemm_gflops(mode) for mode in args.modes}
    print(f"memory {mem:.1f} GB/s; GEMM " + ", ".join(f"{m} {g:.0f} GFLOP/s" for m, g in peaks.items()), flush=True)

    loaded = load_model(None)
    params = sum(w.numel() for n, w in loaded.weights.items() if n != "lm_head.weight")
    max_batch = max(args.batches)
    blocks = max(max_batch * (-(-(args.prompt_len + args.steps + 2) // 16)), max(args.prefill) // 16) + 1
    decode_rows, prefill_rows = [], []
    for mode in args.modes:
        config = EngineConfig(device=args.device, num_kv_blocks=blocks, quantization=mode)
        runner = ModelRunner(config, loaded.config, loaded.weights)
        weight_bytes = sum(b.numel() * b.element_size() for b in runner.model.buffers()) + sum(
            p.numel() * p.element_size() for p in runner.model.parameters())
        decode_throughput(runner, 1, 16, 4)  # warm-up
        for batch in args.batches:
            tps, step = decode_throughput(runner, batch, args.prompt_len, args.steps)
            gemm = linears_ms(runner, batch)
            step_ms = step * 1000
            weights_gbs = weight_bytes / step / 1e9
            gflops = 2 * params * batch / step / 1e9
            decode_rows.append([mode, batch, round(tps, 1), round(step_ms, 1), f"{100 * gemm / step_ms:.0f}%",
                                f"{weights_gbs:.1f} ({100 * weights_gbs / mem:.0f}%)",
                                f"{gflops:.0f} ({100 * gflops / peaks[mode]:.0f}%)"])
            print(f"{mode:5s} batch {batch:3d}: {tps:8.1f} tok/s, {step_ms:7.1f} ms/step, linears {gemm:6.1f} ms",
                  flush=True)
        for length in args.prefill:
            tps = prefill_throughput(runner, length)
            prefill_rows.append([mode, length, round(tps, 1)])
            print(f"{mode:5s} prefill {length:5d}: {tps:8.1f} prompt tok/s", flush=True)
        del runner
    rss = [[mode, round(peak_load_rss_mb(mode))] for mode in args.modes]
    rss.append(["none, whole float32 state dict first (the loader before)", round(peak_load_rss_mb("none", True))])
    print("peak RSS at load (MB):", rss, flush=True)

    body = "\n".join([
        "## Model execution (`python benchmarks/bench_model.py`)",
        "",
        f"Machine: {machine_description()}. Measured in the same run: memory copy bandwidth **{mem:.1f} GB/s**; "
        "one 512x2048x2048 linear: " + ", ".join(f"{m} **{g:.0f} GFLOP/s**" for m, g in peaks.items()) + ".",
        "",
        f"Model: bundled SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to float32, then converted per mode), device "
        f"{args.device}. Each sequence has a {args.prompt_len}-token prompt, then {args.steps} greedy decode steps "
        "are timed (one token per sequence per step, paged KV, block 16). *linears* = the share of the step that "
        "the model's linears (projections and LM head) take when run alone on the same batch, called one by one "
        "from Python (the int8 step runs its layers inside one native call, so at batch 1 its whole step can take "
        "less than the linears called that way); *weights GB/s* = "
        "weight bytes read per step / step time (batch 1 is bound by it); *GFLOP/s* = 2 x parameters x batch / "
        "step time, against the mode's GEMM peak above.",
        "",
        markdown_table(["mode", "batch", "output tok/s", "ms/step", "linears", "weights GB/s (% of memory)",
                        "GFLOP/s (% of GEMM peak)"], decode_rows),
        "",
        "Prefill (one prompt in one step):",
        "",
        markdown_table(["mode", "prompt tokens", "prompt tok/s"], prefill_rows),
        "",
        "Peak resident memory of a process that loads the model (KV cache excluded):",
        "",
        markdown_table(["mode", "peak RSS MB"], rss),
    ])
    if not args.no_write:
        write_section("model", body)
        print("wrote docs/BENCHMARKS.md (model)")


if __name__ == "__main__":
    main()
