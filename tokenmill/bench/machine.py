"""This machine's own limits, measured in the run that reports against them: copy bandwidth and GEMM throughput."""

from __future__ import annotations

import torch

from tokenmill.bench.stats import median_seconds
from tokenmill.model.quant import make_linear


def memory_bandwidth_gbs() -> float:
    """Copy bandwidth (bytes read + written) of a 256 MB buffer: what streaming weights can reach."""
    src = torch.ones(64 * 2**20)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / median_seconds(lambda: dst.copy_(src), 10) / 1e9


def gemm_gflops(mode: str, m: int = 512, k: int = 2048, n: int = 2048) -> float:
    """Throughput of one large linear of the mode's backend (int8 counts integer ops)."""
    layer = make_linear(mode, k, n)
    layer.load(torch.randn(n, k))
    x = torch.randn(m, k)
    with torch.inference_mode():
        return 2 * m * k * n / median_seconds(lambda: layer(x), 10) / 1e9
