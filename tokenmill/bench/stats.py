"""Per-request serving measurements and their summary (percentiles, throughput, goodput)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of `repeats` calls of fn, after one warm-up call (the model benchmarks' timer)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0  # absolute (time.perf_counter) send time
    ttft: float | None = None  # seconds to the first token event
    e2e: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # absolute arrival time of each streamed token event
    error: str | None = None
    request_id: str | None = None  # the server's id for it (the stream's "id")
    text: str = ""  # the streamed text, all choices joined

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT)."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """mean and percentiles (linear interpolation between closest ranks, numpy's default)."""
    if not values:
        return {"mean": float("nan"), **{f"p{q:g}": float("nan") for q in qs}}
    array = np.asarray(values, dtype=float)
    return {"mean": float(array.mean()), **{f"p{q:g}": float(np.percentile(array, q)) for q in qs}}


def summarize(results: Sequence[RequestResult], duration: float, slo_ttft: float | None = None,
              slo_tpot: float | None = None) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    good = [r for r in ok
            if (slo_ttft is None or (r.ttft is not None and r.ttft <= slo_ttft))
            and (slo_tpot is None or r.tpot is None or r.tpot <= slo_tpot)]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (output_tokens + prompt_tokens) / duration if duration > 0 else 0.0,
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": percentiles([t for r in ok if (t := r.tpot) is not None]),
        "itl_s": percentiles([x for r in ok for x in r.itls]),
        "e2e_s": percentiles([r.e2e for r in ok if r.e2e is not None]),
        "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot},
        "goodput": len(good) / duration if duration > 0 else 0.0,
        "good_share": len(good) / len(results) if results else 0.0,
    }
