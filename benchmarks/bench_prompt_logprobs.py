"""What prompt logprobs (`prompt_logprobs`, lm-eval's loglikelihood requests) cost on prefill: prompt tokens/s
with and without them, side by side in one run, on the bundled model with the default linear layers.

Scoring a prompt runs the LM head and a log-softmax on every prompt row (256 rows at a time), not only the last
one, so its cost is the LM head's share of the model's FLOPs. The model runner is driven directly, as in
bench_model.py. `python benchmarks/bench_prompt_logprobs.py [--runs N]` prints the table and writes the
"prompt_logprobs" section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tokenmill.bench.machine import gemm_gflops, memory_bandwidth_gbs  # noqa: E402
from tokenmill.bench.report import machine_description, markdown_table, write_section  # noqa: E402
from tokenmill.bench.stats import median_seconds  # noqa: E402
from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.core.outputs import ScheduledRequest, SchedulerOutput  # noqa: E402
from tokenmill.executor.model_runner import ModelRunner  # noqa: E402
from tokenmill.model.loader import load_model  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

SETTINGS = {"without": None, "with (top-0)": 0, "with (top-5)": 5}


def prefill_tokens_per_s(runner: ModelRunner, prompt_len: int, top_n: int | None, repeats: int) -> float:
    """Prompt tokens/s for one whole prompt in one step, scoring every prompt token when `top_n` is set."""
    table = list(range(-(-prompt_len // runner.block_size)))
    prompt = [(j * 13) % 1000 + 100 for j in range(prompt_len)]
    params = SamplingParams(temperature=0.0, prompt_logprobs=top_n)
    plan = SchedulerOutput([ScheduledRequest("p", prompt, 0, table, True, params, prompt, [],
                                             score_prompt=top_n is not None)])
    return prompt_len / median_seconds(lambda: runner.execute(plan), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3, help="interleaved repetitions (the spread is over them)")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048])
    args = parser.parse_args()
    loaded = load_model(None)
    runner = ModelRunner(EngineConfig(num_kv_blocks=max(args.prompt_lens) // 16 + 8), loaded.config, loaded.weights)
    bandwidth, gflops = memory_bandwidth_gbs(), gemm_gflops("none")
    rates: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.runs):
        for length in args.prompt_lens:
            for name, top_n in SETTINGS.items():
                rates.setdefault((length, name), []).append(prefill_tokens_per_s(runner, length, top_n, 2))
    rows = []
    for length in args.prompt_lens:
        base = statistics.median(rates[(length, "without")])
        for name in SETTINGS:
            values = rates[(length, name)]
            median = statistics.median(values)
            rows.append([length, name, median, f"{min(values):.0f}-{max(values):.0f}", f"{median / base:.2f}x"])
    table = markdown_table(["prompt tokens", "prompt logprobs", "prefill tok/s (median)", "spread",
                            "vs without"], rows)
    body = (f"## Prompt logprobs: prefill cost\n\n{machine_description()}; linear layers `{runner.quantization}`, "
            f"{args.runs} interleaved runs; this machine in the same run: {bandwidth:.1f} GB/s memory, "
            f"{gflops:.0f} GFLOP/s float32 GEMM.\n`python benchmarks/bench_prompt_logprobs.py --runs "
            f"{args.runs}`\n\n{table}\n")
    print(body)
    write_section("prompt_logprobs", body)


if __name__ == "__main__":
    main()
