"""The periodic stats line an operator reads in the log while the server is busy (the content of vLLM's)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tokenmill.engine.core import StepRecord

logger = logging.getLogger("tokenmill.stats")

DEFAULT_INTERVAL_S = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL


class LoggingStatLogger:
    """Accumulates step stats; `log()` (called every interval) writes one line if anything happened since the
    last line, or something is still running or waiting, and once more when the engine has gone idle."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._since = clock()
        self._prompt_tokens = self._generation_tokens = self._preemptions = 0
        self._queries = self._hits = 0
        self._last_queries = self._last_hits = 0  # the scheduler's cumulative prefix counters
        self._running = self._waiting = 0
        self._kv_usage = 0.0
        self._was_busy = False
        self._draft_tokens = self._accepted_tokens = 0

    def on_step(self, record: StepRecord) -> None:
        s = record.stats
        self._prompt_tokens += s.num_prefill_tokens
        self._generation_tokens += s.num_generated_tokens
        self._preemptions += s.num_preemptions
        self._draft_tokens += s.spec_num_draft_tokens
        self._accepted_tokens += s.spec_num_accepted_tokens
        self._queries += s.prefix_queries - self._last_queries
        self._hits += s.prefix_hits - self._last_hits
        self._last_queries, self._last_hits = s.prefix_queries, s.prefix_hits
        self.on_state(s.num_running, s.num_waiting, s.kv_usage)

    def on_state(self, running: int, waiting: int, kv_usage: float) -> None:
        self._running, self._waiting, self._kv_usage = running, waiting, kv_usage

    def log(self) -> str | None:
        """Write (and return) the line for the interval that ends now, or None when there is nothing to say."""
        now = self.clock()
        elapsed = max(now - self._since, 1e-9)
        busy = bool(self._prompt_tokens or self._generation_tokens or self._running or self._waiting)
        line = None
        if busy or self._was_busy:
            hit_rate = 100.0 * self._hits / self._queries if self._queries else 0.0
            line = (f"Avg prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
                    f"Avg generation throughput: {self._generation_tokens / elapsed:.1f} tokens/s, "
                    f"Running: {self._running} reqs, Waiting: {self._waiting} reqs, "
                    f"KV cache usage: {100.0 * self._kv_usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%, "
                    f"Preemptions: {self._preemptions}")
            if self._draft_tokens:
                line += (f", Speculative acceptance: {100.0 * self._accepted_tokens / self._draft_tokens:.1f}% "
                         f"of {self._draft_tokens} proposed tokens")
            logger.info(line)
        self._was_busy = busy
        self._since = now
        self._prompt_tokens = self._generation_tokens = self._preemptions = self._queries = self._hits = 0
        self._draft_tokens = self._accepted_tokens = 0
        return line
