"""The periodic stats line an operator reads in the log while the server is busy (the content of vLLM's)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tokenmill.core.outputs import StepRecord

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
        self._last_prefix: dict[int, tuple[int, int]] = {}  # per replica: its scheduler's cumulative counters
        self._state: dict[int, tuple[int, int, float]] = {}  # per replica: running, waiting, KV usage
        self._was_busy = False
        self._draft_tokens = self._accepted_tokens = 0
        self._over_target = 0  # --target-itl-ms: steps over it since the last line, and the slowest
        self._slowest_over = 0.0
        self._migrations = 0  # requests moved off a dead engine core since the last line
        self._tiers: dict[int, dict[str, float]] = {}  # per replica: its KV tiers' cumulative counters
        self._tier_hits_shown = {"host": 0.0, "disk": 0.0}  # their sum at the last line

    def on_migration(self, request_id: str, source: int, target: int | None) -> None:
        self._migrations += 1

    def on_step(self, record: StepRecord, replica: int = 0) -> None:
        s = record.stats
        self._prompt_tokens += s.num_prefill_tokens
        self._generation_tokens += s.num_generated_tokens
        self._preemptions += s.num_preemptions
        self._draft_tokens += s.spec_num_draft_tokens
        self._accepted_tokens += s.spec_num_accepted_tokens
        if s.over_target:
            self._over_target += 1
            self._slowest_over = max(self._slowest_over, s.step_seconds or 0.0)
        last_queries, last_hits = self._last_prefix.get(replica, (0, 0))
        if s.prefix_queries < last_queries:  # a restarted replica counts from zero again
            last_queries = last_hits = 0
        self._queries += s.prefix_queries - last_queries
        self._hits += s.prefix_hits - last_hits
        self._last_prefix[replica] = (s.prefix_queries, s.prefix_hits)
        if s.kv_tiers is not None:
            self._tiers[replica] = s.kv_tiers
        self.on_state(s.num_running, s.num_waiting, s.kv_usage, replica)

    def on_state(self, running: int, waiting: int, kv_usage: float, replica: int = 0) -> None:
        self._state[replica] = (running, waiting, kv_usage)

    @property
    def running(self) -> int:
        return sum(r for r, _, _ in self._state.values())

    @property
    def waiting(self) -> int:
        return sum(w for _, w, _ in self._state.values())

    @property
    def kv_usage(self) -> float:  # the replicas' mean
        return sum(k for _, _, k in self._state.values()) / len(self._state) if self._state else 0.0

    def log(self) -> str | None:
        """Write (and return) the line for the interval that ends now, or None when there is nothing to say."""
        now = self.clock()
        elapsed = max(now - self._since, 1e-9)
        busy = bool(self._prompt_tokens or self._generation_tokens or self.running or self.waiting
                    or self._migrations)
        line = None
        if busy or self._was_busy:
            hit_rate = 100.0 * self._hits / self._queries if self._queries else 0.0
            line = (f"Avg prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
                    f"Avg generation throughput: {self._generation_tokens / elapsed:.1f} tokens/s, "
                    f"Running: {self.running} reqs, Waiting: {self.waiting} reqs, "
                    f"KV cache usage: {100.0 * self.kv_usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%, "
                    f"Preemptions: {self._preemptions}")
            if self._draft_tokens:
                line += (f", Speculative acceptance: {100.0 * self._accepted_tokens / self._draft_tokens:.1f}% "
                         f"of {self._draft_tokens} proposed tokens")
            if self._over_target:
                line += (f", Steps over the ITL target: {self._over_target} (slowest "
                         f"{1e3 * self._slowest_over:.0f} ms)")
            if self._migrations:
                line += f", Migrated requests: {self._migrations}"
            if self._tiers:
                hits = {tier: sum(c.get(f"{tier}_hits", 0) for c in self._tiers.values()) for tier in ("host", "disk")}
                new = {tier: max(0.0, hits[tier] - self._tier_hits_shown[tier]) for tier in hits}
                line += f", KV tier hits: {new['host']:.0f} host, {new['disk']:.0f} disk blocks"
                self._tier_hits_shown = hits
            logger.info(line)
        self._was_busy = busy
        self._since = now
        self._prompt_tokens = self._generation_tokens = self._preemptions = self._queries = self._hits = 0
        self._draft_tokens = self._accepted_tokens = 0
        self._over_target, self._slowest_over = 0, 0.0
        self._migrations = 0
        return line
