"""Where a decode step's milliseconds go: torch's profiler over a few steps of the real model runner.

`python benchmarks/profile_step.py --batch 1 --quantization int8` prints the step time, the time inside torch
ops by op (the native kernels run through ctypes and show up as the gap between the two), and the top ops.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from tokenmill.config import EngineConfig
from tokenmill.core.outputs import ScheduledRequest, SchedulerOutput
from tokenmill.executor.model_runner import ModelRunner
from tokenmill.model.loader import load_model
from tokenmill.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per sequence before the steps")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--rows", type=int, default=20, help="ops to list")
    args = parser.parse_args()

    loaded = load_model(None)
    blocks_per_seq = -(-(args.context + 3 * args.steps + 2) // 16)
    config = EngineConfig(quantization=args.quantization, num_kv_blocks=args.batch * blocks_per_seq + 1)
    runner = ModelRunner(config, loaded.config, loaded.weights)
    params = SamplingParams(temperature=0.0)
    seqs = [(f"r{i}", list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
             [(7 * i + j) % 1000 + 100 for j in range(args.context)], []) for i in range(args.batch)]
    for rid, table, prompt, out in seqs:  # prefill one by one
        result = runner.execute(SchedulerOutput([ScheduledRequest(rid, prompt, 0, table, True, params, prompt, out)]))
        out.append(result.sampled_token_ids[rid])

    def step() -> None:
        plan = [ScheduledRequest(rid, out[-1:], len(prompt) + len(out) - 1, table, True, params, prompt, out)
                for rid, table, prompt, out in seqs]
        result = runner.execute(SchedulerOutput(plan))
        for rid, _, _, out in seqs:
            out.append(result.sampled_token_ids[rid])

    for _ in range(args.steps):  # warm-up, unprofiled timing
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    step_ms = (time.perf_counter() - start) / args.steps * 1000
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    averages = prof.key_averages()
    in_ops_ms = sum(e.self_cpu_time_total for e in averages) / 1000 / args.steps
    print(f"{Path(sys.argv[0]).name}: {runner.quantization}, batch {args.batch}, context ~{args.context}: "
          f"{step_ms:.1f} ms/step unprofiled; {in_ops_ms:.1f} ms/step inside torch ops (self time, profiled); "
          "the rest is native kernels (ctypes) and Python")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
