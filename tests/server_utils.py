"""The server tests use the same child-process launcher as the benchmarks."""

from __future__ import annotations

import time

import httpx

from tokenmill.bench.server_process import LiveServer, free_port, live_server
from tokenmill.server.metrics import metric_value

__all__ = ["LiveServer", "assert_idle_soon", "free_port", "live_server"]


def assert_idle_soon(base_url: str, timeout: float = 5.0) -> None:
    """Nothing running, nothing waiting and no KV block held, within `timeout` (aborted streams leaked nothing)."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(base_url + "/metrics").text
        gauges = [metric_value(text, f"tokenmill:{name}") for name in
                  ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")]
        if gauges == [0, 0, 0]:
            return
        assert time.monotonic() < deadline, gauges
        time.sleep(0.05)
