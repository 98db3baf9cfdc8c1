"""The entry point of an engine-core process: pin to its CPUs, load the model, say hello, run the core loop.

Imports stay light at the top: the CPU set and thread count must be fixed before torch opens its thread pool
(a core forked from the fork server has torch imported, but no thread pool opened yet: process_start.py).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

# While idle the loop blocks this long on its input at most, then checks that its parent is still there.
IDLE_POLL_MS = 500


@dataclass
class CoreProcessOptions:
    index: int
    cpus: list[int] | None  # None: leave the affinity alone
    input_address: str  # the front end's PUSH socket (commands)
    output_address: str  # the front end's PULL socket (reports)
    send_plans: bool = False
    kv_events: bool = True
    log_level: str = "INFO"
    num_threads: int | None = None  # torch threads when not pinned (default: one per CPU of `cpus`)
    niceness: int = 0  # added to the process's nice value: > 0 yields its CPUs to the processes it shares them with
    # the launching process's environment now (a forked core would otherwise see the fork server's, from its start)
    environment: dict[str, str] | None = None


def run_engine_core(config: Any, options: CoreProcessOptions) -> None:
    """Process main (multiprocessing spawn target, or a Ray actor's method)."""
    started = time.monotonic()
    # The API server owns the terminal and SIGTERM (it drains, then stops the cores); the core goes when told
    # to, or when its parent is gone.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if options.environment is not None:
        os.environ.clear()
        os.environ.update(options.environment)
    threads = len(options.cpus) if options.cpus else options.num_threads
    if options.cpus:
        os.sched_setaffinity(0, options.cpus)
    if options.niceness:
        os.nice(options.niceness)
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    logging.basicConfig(level=options.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[core {options.index}]: %(message)s")
    import torch

    from tokenmill.engine.core_loop import CoreLoop
    from tokenmill.engine.core_messages import Command, CoreDeath, CoreInfo, CoreReport, kv_format_name

    if threads:
        torch.set_num_threads(threads)
    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    commands.connect(options.input_address)
    reports = context.socket(zmq.PUSH)
    reports.connect(options.output_address)
    parent = os.getppid()
    try:
        from tokenmill.engine.llm_engine import engine_core_from_config

        core = engine_core_from_config(config)
    except Exception as exc:  # the front end reports it and gives up on this replica
        logging.getLogger("tokenmill.engine").exception("engine core %d failed to start", options.index)
        reports.send_pyobj(CoreDeath(f"failed to start: {exc!r}"))
        reports.close(linger=2000)
        return
    # Everything built so far (weights' metadata, the block pool) lives as long as the process:
    # out of the collector's sight, a full collection no longer walks it (measured here: 80-200 ms pauses of the
    # engine loop without this, as vLLM found).
    gc.collect()
    gc.freeze()
    reports.send_pyobj(CoreInfo(core.kv.num_blocks, core.kv.block_size,
                                int(getattr(core.executor, "kv_cache_bytes", 0)), core.scheduler.max_model_len,
                                start_seconds=time.monotonic() - started, rss_bytes=_rss_bytes(), cpus=options.cpus,
                                kv_cache_dtype=kv_format_name(core.executor)))

    def receive(block: bool) -> list[Command] | None:
        if not commands.poll(IDLE_POLL_MS if block else 0):
            return None if os.getppid() != parent else []
        received: list[Command] = []
        while True:
            try:
                command = commands.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return received
            if command[1] == "shutdown":
                return None
            received.append(command)

    def publish(message: CoreReport | CoreDeath) -> None:
        reports.send_pyobj(message)

    loop = CoreLoop(core, publish, mirror_requests=True, send_plans=options.send_plans,
                    kv_events=options.kv_events)
    loop.run(receive)
    reports.close(linger=2000)
    commands.close(linger=0)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
