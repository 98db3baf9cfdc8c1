"""Kernel choices, measured: the 30 layers' linears and the LM head of SmolLM2-135M per backend, and the
attention kernel against the torch reference path, at decode batch sizes.

Weights are random with the model's shapes, one distinct copy per layer (so they stream from memory as in a real
step); each time is the median of several runs. `python benchmarks/bench_kernels.py` prints the tables and
writes the "kernels" section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import torch

from tokenmill import kernels
from tokenmill.bench.report import machine_description, markdown_table, write_section
from tokenmill.bench.stats import median_seconds
from tokenmill.model.attention import AttentionMetadata, _decode_attention_torch, allocate_layer_kv
from tokenmill.model.kv_quant import kv_format
from tokenmill.model.linear import QuantLinear
from tokenmill.model.quant import make_linear
from tokenmill.platform import cpu_flags

LAYERS = 30
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out): qkv, o, gate_up, down
HEAD = (576, 49152)
# distinct LM-head copies timed in turn (the time shown is per copy): one int8 head (27 MiB) fits this class of
# host's L3 and would be read from cache on every repeat, unlike a real step's
HEAD_COPIES = 4


def median_ms(fn: Callable[[], object], repeats: int = 7) -> float:
    return 1000 * median_seconds(fn, repeats)


def linears(mode: str, shapes: list[tuple[int, int]], copies: int) -> list[QuantLinear]:
    layers = []
    for _ in range(copies):
        for k, n in shapes:
            layer = make_linear(mode, k, n)
            layer.load(torch.randn(n, k) * 0.05)
            layers.append(layer)
    return layers


def time_linears(layers: list[QuantLinear], batch: int) -> float:
    inputs = {layer.in_features: torch.randn(batch, layer.in_features) for layer in layers}
    with torch.inference_mode():
        return median_ms(lambda: [layer(inputs[layer.in_features]) for layer in layers])


def time_int8_schemes(batch: int) -> tuple[float, float]:
    """The 30 layers' whole int8 linears (quantize, GEMM, dequantize), ms: activations per group of 32 through
    the VNNI kernel, and two levels per row through oneDNN (`torch._int_mm`, 2 x batch rows), the path of CPUs
    without AVX512-VNNI."""
    grouped = linears("int8", SHAPES, LAYERS)
    two_level = linears("int8", SHAPES, LAYERS)
    for layer in two_level:
        layer.packed = None  # type: ignore[assignment]
    return time_linears(grouped, batch), time_linears(two_level, batch)


def time_attention(batch: int, context: int) -> dict[str, float | None]:
    """ms of one layer's decode attention over `batch` sequences of `context` tokens: the native kernel over a
    float32, a bf16 (None without AVX-512) and an int8 cache, and the torch reference (float32 cache)."""
    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    blocks = -(-context // block)
    tables = np.random.RandomState(0).permutation(batch * blocks).reshape(batch, blocks).astype(np.int64)
    meta = AttentionMetadata.build(np.ones(batch, np.int64), np.full(batch, context, np.int64), tables,
                                   np.zeros(batch, np.int64), block, torch.device("cpu"))
    q = torch.randn(batch, heads, head_dim)
    out = torch.empty_like(q)
    times: dict[str, float | None] = {}
    for name in ("float32", "bfloat16", "int8"):
        fmt = kv_format(name)
        cache = allocate_layer_kv(batch * blocks + 1, block, kv_heads, head_dim, fmt, torch.device("cpu"))
        for values, scales in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
            if scales is None:
                values.copy_(torch.randn(values.shape))
            else:
                values.copy_(torch.randint(-127, 128, values.shape, dtype=torch.int8))
                scales.fill_(0.01)
        if not kernels.attention_supported(q, heads, cache):
            times[name] = None
            continue
        times[name] = median_ms(lambda c=cache: kernels.paged_attention(  # type: ignore[misc]
            out, q, c, meta.query_start, meta.seq_lens, meta.block_tables, 0.125))
        if name == "float32":
            times["reference"] = median_ms(lambda c=cache: _decode_attention_torch(  # type: ignore[misc]
                q, c, meta.reference, 0.125))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    rows = []
    for mode in ("none", "bf16", "int8"):
        body, head = linears(mode, SHAPES, LAYERS), linears(mode, [HEAD], HEAD_COPIES)
        row: list[object] = [mode]
        for batch in args.batches:
            row += [round(time_linears(body, batch), 1), round(time_linears(head, batch) / HEAD_COPIES, 1)]
        rows.append(row)
        print(row, flush=True)
    headers = ["backend"] + [f"{part} M={b}" for b in args.batches for part in ("layers", "head")]
    int8_rows: list[list[object]] = []
    if kernels.int8_grouped_available():
        for batch in (1, 8, 32, 64, 128, 512):
            grouped, two_level = time_int8_schemes(batch)
            int8_rows.append([batch, round(grouped, 1), round(two_level, 1), f"{two_level / grouped:.2f}"])
            print(int8_rows[-1], flush=True)
    attention_rows: list[list[object]] = []
    for batch, context in ((1, 512), (8, 512), (32, 256), (64, 160), (64, 1024)):
        times = time_attention(batch, context)
        attention_rows.append([batch, context, *("-" if times[name] is None else round(times[name], 2)  # type: ignore[arg-type]
                                                 for name in ("float32", "bfloat16", "int8", "reference"))])
        print(attention_rows[-1], flush=True)
    simd = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16"})
    text = "\n".join([
        "## Kernels (`python benchmarks/bench_kernels.py`)",
        "",
        f"Machine: {machine_description()}; CPU features: {', '.join(simd) or 'none of note'}. SmolLM2-135M "
        "shapes, random weights, a distinct copy per layer; ms, median of 7. int8 includes the activations' "
        "quantization and the dequantization.",
        "",
        markdown_table(headers, rows),
        "",
        "The 30 layers' whole int8 linears by activation scheme: one level per group of 32 (the VNNI kernel, "
        "`kernels/int8_rows.c`, this machine's path) against two levels per row through oneDNN's "
        "`torch._int_mm` (the path of CPUs without AVX512-VNNI; twice the GEMM rows):" if int8_rows else "",
        "",
        markdown_table(["batch", "grouped, VNNI kernel ms", "two levels, oneDNN ms", "speed-up"], int8_rows)
        if int8_rows else "",
        "",
        "One layer's decode attention (9 heads, 3 KV heads, 64 dims, blocks of 16, shuffled): the native kernel "
        "reading blocks in place from a float32, a bf16 and an int8 cache, against the torch reference (gather "
        "padded blocks + SDPA, float32):",
        "",
        markdown_table(["sequences", "context tokens", "native fp32 cache ms", "native bf16 cache ms",
                        "native int8 cache ms", "torch reference ms"], attention_rows),
    ])
    if not args.no_write:
        write_section("kernels", text)
        print("wrote docs/BENCHMARKS.md (kernels)")


if __name__ == "__main__":
    main()
