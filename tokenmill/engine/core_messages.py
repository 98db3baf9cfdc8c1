"""The messages between an engine core and its front end: commands in, reports out (plain data; they are pickled
across a process boundary, and the front end reads them without importing the engine or torch)."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.core.block_pool import KVEvent
from tokenmill.core.outputs import EngineCoreOutput, StepRecord
from tokenmill.request import Request

# (sequence number, kind, payload); kinds: "add" (list[Request]), "abort" / "finish" (list of request ids)
Command = tuple[int, str, Any]


def kv_format_name(executor: object) -> str:
    """The name of an executor's KV cache format ("" for one without a KV pool of its own, e.g. a fake)."""
    fmt = getattr(executor, "kv_format", None)
    return "" if fmt is None else str(fmt.name)


@dataclass
class CoreInfo:
    """A core's hello once its model is loaded: what the front end needs to validate and route requests."""

    num_kv_blocks: int
    block_size: int
    kv_cache_bytes: int
    max_model_len: int
    pid: int = field(default_factory=os.getpid)
    hostname: str = field(default_factory=socket.gethostname)
    clock: float = field(default_factory=time.monotonic)  # the core's monotonic clock when it said hello
    start_seconds: float = 0.0  # from process start to ready (imports, model load, warm-up)
    rss_bytes: int = 0  # the core process's resident memory when ready
    cpus: list[int] | None = None  # the CPUs it is pinned to
    kv_cache_dtype: str = ""  # the KV pool's element format (model/kv_quant.py)


@dataclass
class RequestSync:
    """A request's progress as the core saw it, for a front end that holds its own copy of the request (the
    output processor reads timestamps and cache hits from it): the timestamps set so far and the token times
    added since the last sync."""

    request_id: str
    first_scheduled: float | None
    first_token: float | None
    last_token: float | None
    finished: float | None
    new_token_times: list[float]
    num_cached_tokens: int
    num_preemptions: int
    num_recomputed_tokens: int
    new_prefill_chunks: list[tuple[float, float, int]] = field(default_factory=list)

    def apply(self, request: Request, clock_offset: float = 0.0) -> None:
        def shift(t: float | None) -> float | None:
            return None if t is None else t + clock_offset

        times = request.times
        # the first core's, should the request have moved (engine/migration.py): TTFT is the client's
        if times.first_scheduled is None:
            times.first_scheduled = shift(self.first_scheduled)
        if times.first_token is None:
            times.first_token = shift(self.first_token)
        times.last_token, times.finished = shift(self.last_token), shift(self.finished)
        times.token_times.extend(t + clock_offset for t in self.new_token_times)
        times.prefill_chunks.extend((start + clock_offset, end + clock_offset, tokens)
                                    for start, end, tokens in self.new_prefill_chunks)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = self.num_cached_tokens
        request.num_preemptions = self.num_preemptions
        request.num_recomputed_tokens = self.num_recomputed_tokens


@dataclass
class CoreReport:
    """What a core publishes after applying commands (no step) or after a step."""

    outputs: list[EngineCoreOutput]
    record: StepRecord | None  # None when no step ran
    running: int
    waiting: int
    kv_usage: float
    load_tokens: int  # waiting + running tokens
    acked: int  # sequence number of the last command applied
    kv_events: list[KVEvent] = field(default_factory=list)
    syncs: list[RequestSync] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # requests of a step that raised (they are aborted)
    error: str | None = None  # why they failed
    rejected: list[str] = field(default_factory=list)  # adds refused by the core (a race with validation)
    rejected_error: str | None = None
    kv_loaded: list[tuple[str, int, float]] = field(default_factory=list)  # consumer: (request, bytes, seconds)
    kv_pending: int = 0  # producer: saved KV not yet released
    kv_failed: list[str] = field(default_factory=list)  # consumer: requests whose KV could not be fetched


@dataclass
class CoreDeath:
    """The core's loop stopped after an error its state cannot survive; its process exits next."""

    message: str
