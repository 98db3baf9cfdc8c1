"""The quantized GEMM path against this machine's int8 peak, at the kernels' instruction-set level (this CPU's,
or `TOKENMILL_ISA`): prompt-chunk shapes (rows >= 64) of Qwen2.5-0.5B and 1.5B through the grouped int8 kernel
(`-q int8`) and the GGUF row panels on the blocks a Q4_K_M file holds (`-q gguf`), in GOP/s (2 x multiply-adds
per second) and as a fraction of the peak that `int8_peak_probe.c` measures in the same run (the multiply-add
instruction sequence the kernels use, in a tight loop of independent chains on every thread).

`python benchmarks/bench_gemm_peak.py [--runs N]` prints the table and writes the "gemm-peak" section of
docs/BENCHMARKS.md (under TOKENMILL_ISA=LEVEL, "gemm-peak-LEVEL").
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tokenmill import kernels  # noqa: E402
from tokenmill.bench.report import machine_description, markdown_table, write_section  # noqa: E402
from tokenmill.isa import cpu_level  # noqa: E402
from tokenmill.model.quant import make_linear  # noqa: E402
from tokenmill.platform import isa_level, raw_cpu_flags  # noqa: E402

Q4_K, Q4_K_BYTES, Q5_0 = 12, 144, 6  # GGML type ids; bytes of one 256-value Q4_K block
# (model, layer, k, n): the linear layers of a decoder layer
SHAPES = [("Qwen2.5-0.5B", "qkv", 896, 1152), ("Qwen2.5-0.5B", "gate_up", 896, 9728),
          ("Qwen2.5-0.5B", "down", 4864, 896), ("Qwen2.5-1.5B", "qkv", 1536, 2048),
          ("Qwen2.5-1.5B", "gate_up", 1536, 17920), ("Qwen2.5-1.5B", "down", 8960, 1536)]


def probe_peak_gops(seconds: float = 0.5) -> float:
    """int8 GOP/s of the probe on every thread of the team, built with the kernels' flags."""
    source = Path(__file__).with_name("int8_peak_probe.c")
    with tempfile.TemporaryDirectory() as tmp:
        library = Path(tmp) / "probe.so"
        subprocess.run(["gcc", *kernels.build_flags(), str(source), "-o", str(library)], check=True)
        probe = ctypes.CDLL(str(library))
    probe.probe_run.argtypes, probe.probe_run.restype = [ctypes.c_int64], ctypes.c_int64
    macs, chains = probe.probe_macs_per_op(), probe.probe_chains()
    if macs == 0:
        return float("nan")
    iterations = 1 << 16
    while True:
        start = time.perf_counter()
        probe.probe_run(iterations)
        elapsed = time.perf_counter() - start
        if elapsed > seconds:
            break
        iterations *= 2
    return 2 * torch.get_num_threads() * iterations * chains * macs / elapsed / 1e9


def gguf_plan(k: int, n: int, seed: int) -> tuple[kernels.GGUFMatmulPlan, str]:
    """An n x k tensor as a Q4_K_M file stores it: Q4_K blocks (random bytes, finite fp16 scales), or Q5_0 where k
    is no multiple of 256 (llama.cpp's fallback: Qwen2.5-0.5B's 896 inputs)."""
    rng = np.random.default_rng(seed)
    if k % 256:
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        weight = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        data = np.ascontiguousarray(quantize(weight, GGMLQuantizationType.Q5_0)).view(np.uint8).reshape(n, -1)
        return kernels.GGUFMatmulPlan([(data, Q5_0, n, None)], k), "Q5_0"
    blocks = rng.integers(0, 256, (n * k // 256, Q4_K_BYTES), dtype=np.uint8)
    for at in (0, 2):  # d and dmin
        scales = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16)
        blocks[:, at:at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return kernels.GGUFMatmulPlan([(blocks.reshape(n, -1), Q4_K, n, None)], k), "Q4_K"


def time_gops(fn: object, x: torch.Tensor, n: int, repeats: int) -> float:
    """GOP/s of y = fn(x) for x [rows, k] against n outputs: the best of `repeats` calls after a warm-up."""
    assert callable(fn)
    fn(x)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - start)
    return 2 * x.shape[0] * x.shape[1] * n / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="measurements per cell, the paths interleaved")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 512], help="prompt-chunk rows")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    torch.set_num_threads(2)
    level = isa_level() or cpu_level(raw_cpu_flags())
    peaks = [probe_peak_gops()]
    print(f"kernels for {level}; int8 peak {peaks[0]:.0f} GOP/s", flush=True)
    rows_out = []
    for model, layer, k, n in SHAPES:
        int8 = make_linear("int8", k, n, bias=False)
        int8.load(torch.randn(n, k) * 0.05)
        plan, kind = gguf_plan(k, n, seed=k + n)
        for rows in args.rows:
            x = torch.randn(rows, k)
            cells: dict[str, list[float]] = {"int8": [], "gguf": []}
            for _ in range(args.runs):
                cells["int8"].append(time_gops(int8, x, n, 3))
                cells["gguf"].append(time_gops(lambda t, p=plan: kernels.gguf_matmul(t, p), x, n, 3))
            peaks.append(probe_peak_gops(0.2))
            peak = statistics.median(peaks)
            row = [model, layer, f"{k}x{n}", kind, rows]
            for path in ("int8", "gguf"):
                values = cells[path]
                best = statistics.median(values)
                row += [f"{best:.0f} ({min(values):.0f}-{max(values):.0f})", f"{best / peak:.0%}"]
            rows_out.append(row)
            print(row, flush=True)
        del int8, plan
    peak = statistics.median(peaks)
    table = markdown_table(["model", "layer", "k x n", "GGUF type", "rows", "int8 GOP/s", "of peak", "gguf GOP/s",
                            "of peak"], rows_out)
    print(table)
    if args.no_write:
        return
    command = f"{'' if isa_level() is None else f'TOKENMILL_ISA={level} '}python benchmarks/bench_gemm_peak.py"
    text = (f"## Quantized GEMM against the int8 peak, {level} kernels (`{command}`)\n\n"
            f"Machine: {machine_description()}. Peak: {peak:.0f} GOP/s (median of {len(peaks)} probes through the "
            f"run, spread {min(peaks):.0f}-{max(peaks):.0f}): `benchmarks/int8_peak_probe.c`, the multiply-add "
            "sequence of this level's kernels in 12 independent chains on each of the 2 threads. Each cell: the "
            f"median (min-max) of {args.runs} interleaved measurements, each the best of 3 calls; a call includes "
            "quantizing the activations per group of 32.\n\n" + table)
    section = "gemm-peak" if isa_level() is None else f"gemm-peak-{level}"
    write_section(section, text)
    print(f"wrote docs/BENCHMARKS.md ({section})")


if __name__ == "__main__":
    main()
