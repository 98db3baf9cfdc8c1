"""GGUF weights executed as stored (`--quantization gguf`) against the int8 backend, on the same files, side by
side in one run: decode tokens/s at batch 1 and 8, prompt tokens/s, and the bytes of weights a decode step
reads against this machine's memory bandwidth (measured in the same run).

Models: the bundled SmolLM2 (Q4_1/Q8_0) and every file `python -m tests.real_models` fetched. The model runner
is driven directly (bench_model.py's decode and prefill loops), so the numbers are the model step itself.
`python benchmarks/bench_gguf.py [--runs N]` prints the table and writes the "gguf" section of
docs/BENCHMARKS.md; under `TOKENMILL_ISA=LEVEL` (a lower instruction-set level's kernels) the "gguf-LEVEL" one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_model import decode_throughput, prefill_throughput  # noqa: E402

from tests.real_models import DECODER_MODELS, cache_dir  # noqa: E402
from tokenmill.bench.machine import memory_bandwidth_gbs  # noqa: E402
from tokenmill.bench.report import machine_description, markdown_table, write_section  # noqa: E402
from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.executor.model_runner import ModelRunner  # noqa: E402
from tokenmill.model.gguf_linear import GGUFLinear  # noqa: E402
from tokenmill.model.int8_linear import Int8Linear  # noqa: E402
from tokenmill.model.linear import QuantLinear  # noqa: E402
from tokenmill.model.loader import bundled_model_path, load_model  # noqa: E402
from tokenmill.platform import isa_level  # noqa: E402

MODES = ("int8", "gguf")


def weight_bytes_per_step(runner: ModelRunner) -> int:
    """Bytes of linear-layer weights one decode step reads (the embedding rows it looks up are negligible)."""
    total = 0
    for layer in runner.model.modules():
        if isinstance(layer, GGUFLinear) and layer.fallback is None:
            total += sum(part.data.nbytes for part, _ in layer.parts)
        elif isinstance(layer, (Int8Linear, GGUFLinear)):
            int8 = layer if isinstance(layer, Int8Linear) else layer.fallback
            assert int8 is not None
            weights = int8.packed if int8.packed is not None else int8.qweight
            total += weights.numel() + int8.scale.numel() * 4
        elif isinstance(layer, QuantLinear):
            total += sum(b.numel() * b.element_size() for b in layer.buffers()) + sum(
                p.numel() * p.element_size() for p in layer.parameters())
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3, help="measurements per cell (median and range)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    mem = memory_bandwidth_gbs()
    print(f"memory {mem:.1f} GB/s", flush=True)
    models = [Path(bundled_model_path())] + [cache_dir() / m.file for m in DECODER_MODELS
                                            if (cache_dir() / m.file).exists()]
    rows = []
    for path in models:
        loaded = load_model(str(path))
        runners = {mode: ModelRunner(EngineConfig(quantization=mode, num_kv_blocks=300), loaded.config,
                                     loaded.weights) for mode in MODES}
        cells: dict[str, dict[str, list[float]]] = {mode: {"b1": [], "b8": [], "p512": []} for mode in MODES}
        for runner in runners.values():
            decode_throughput(runner, 1, 16, 4)  # warm-up
        for _ in range(args.runs):  # the modes alternate, so drift hits both alike
            for mode, runner in runners.items():
                cells[mode]["b1"].append(decode_throughput(runner, 1, 128, args.steps)[0])
                cells[mode]["b8"].append(decode_throughput(runner, 8, 128, args.steps)[0])
                cells[mode]["p512"].append(prefill_throughput(runner, 512))
        for mode, runner in runners.items():
            streamed = weight_bytes_per_step(runner)
            b1 = statistics.median(cells[mode]["b1"])

            def cell(values: list[float]) -> str:
                return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"

            rows.append([path.name, mode, f"{streamed / 1e6:.0f}", cell(cells[mode]["b1"]),
                         f"{streamed * b1 / 1e9:.1f} ({100 * streamed * b1 / 1e9 / mem:.0f}%)",
                         cell(cells[mode]["b8"]), cell(cells[mode]["p512"])])
            print(rows[-1], flush=True)
        del runners
    headers = ["file", "mode", "weights read per step (MB)", "decode b1 tok/s", "GB/s at b1 (of memory)",
               "decode b8 tok/s", "prompt 512 tok/s"]
    table = markdown_table(headers, rows)
    print(table)
    if args.no_write:
        return
    level = isa_level()
    command = f"{'' if level is None else f'TOKENMILL_ISA={level} '}python benchmarks/bench_gguf.py --runs {args.runs}"
    text = (f"## GGUF blocks executed as stored vs int8{'' if level is None else f', {level} kernels'} "
            f"(`python benchmarks/bench_gguf.py`)\n\n"
            f"Machine: {machine_description()}; memory {mem:.1f} GB/s measured in the same run. "
            f"`{command}`: the model runner alone (no scheduler), "
            f"decode after a 128-token prompt, median (min-max) of {args.runs} alternating runs.\n\n{table}\n\n"
            "`gguf` executes the file's blocks (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K; other tensors int8) with "
            "the row panels of kernels/gguf_panels.c (AVX512-VNNI or AVX2; else kernels/gguf_matmul.c); `int8` "
            "re-quantizes every tensor to int8 per output channel and runs the grouped int8 kernel. Both run every "
            "layer in the one-call native "
            "decoder stack (kernels/decoder.c), on every family.")
    section = "gguf" if level is None else f"gguf-{level}"
    write_section(section, text)
    print(f"wrote docs/BENCHMARKS.md ({section})")


if __name__ == "__main__":
    main()
