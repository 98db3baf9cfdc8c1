"""Engine-core replicas as the front end sees them: something it sends commands to and hears reports from.

- `ThreadReplica`: the core steps in a thread of the API server's process (offline tools, tests, and
  `TOKENMILL_ENABLE_MULTIPROCESSING=0`); it shares the requests with the front end, so reports carry no syncs.
- `ProcessReplica`: the core runs in its own process (forked from a fork server that has imported the engine:
  engine/process_start.py), pinned to its share of the CPUs,
  over two ZeroMQ sockets (commands in, reports out; pickle framing). The front end binds both, so a process can
  be replaced without the front end moving; each launch gets fresh addresses, so nothing queued for a dead
  process reaches its successor.

Reports reach the front end through `deliver`, called from a background thread; the front end hops them onto
its event loop.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from tokenmill.config import EngineConfig
from tokenmill.engine.core_messages import Command, CoreDeath, CoreInfo, CoreReport, kv_format_name
from tokenmill.engine.core_proc import CoreProcessOptions, run_engine_core
from tokenmill.engine.process_start import core_process_context

if TYPE_CHECKING:
    from tokenmill.engine.core import EngineCore

logger = logging.getLogger("tokenmill.engine")

# A core has this long to load its model and say hello.
START_TIMEOUT_S = 600.0


@dataclass
class ReplicaExit:
    """The replica's process is gone (exit code, or a signal as a negative number)."""

    exitcode: int | None


Message = CoreReport | CoreDeath | ReplicaExit
Deliver = Callable[[Message], None]


class Replica:
    """State shared by the kinds of replica. `state`: starting, up, down (its requests failed), restarting,
    failed (gave up restarting), stopping (the front end is shutting down)."""

    can_restart = False

    def __init__(self, index: int, role: str | None = None) -> None:
        self.index = index
        self.role = role  # disaggregated: "producer" (prefill) or "consumer" (decode); None: both
        self.state = "starting"
        self.info: CoreInfo | None = None
        self.restarts = 0
        self.generation = 0  # launches so far; reports of an earlier launch are ignored
        self._seq = itertools.count(1)

    @property
    def pid(self) -> int | None:
        return self.info.pid if self.info else None

    def launch(self) -> CoreInfo:
        """Bring the core up (blocking) and return its hello."""
        raise NotImplementedError

    def start(self, deliver: Deliver) -> None:
        """Begin delivering its reports."""
        raise NotImplementedError

    def send(self, kind: str, payload: Any) -> int:
        """Queue a command; returns its sequence number (reports acknowledge up to one)."""
        raise NotImplementedError

    def stop(self, timeout: float = 10.0) -> None:
        raise NotImplementedError


class ThreadReplica(Replica):
    """The core in a background thread of this process; commands through a deque drained between steps."""

    def __init__(self, index: int, core: EngineCore, send_plans: bool = True) -> None:
        super().__init__(index, core.config.kv_role)
        self.core = core
        self.send_plans = send_plans
        self._commands: deque[Command] = deque()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None

    def launch(self) -> CoreInfo:
        kv = self.core.kv
        self.info = CoreInfo(kv.num_blocks, kv.block_size, int(getattr(self.core.executor, "kv_cache_bytes", 0)),
                             self.core.scheduler.max_model_len, kv_cache_dtype=kv_format_name(self.core.executor))
        self.generation += 1
        return self.info

    def start(self, deliver: Deliver) -> None:
        # imported here: a process replica's front end never imports the engine (nor torch)
        from tokenmill.engine.core_loop import CoreLoop

        loop = CoreLoop(self.core, deliver, send_plans=self.send_plans)
        self._thread = threading.Thread(target=loop.run, args=(self._receive,), name="tokenmill-engine",
                                        daemon=True)
        self._thread.start()

    def _receive(self, block: bool) -> list[Command] | None:
        if block:
            self._wake.wait(0.5)
            self._wake.clear()
        if self._stop:
            return None
        commands = []
        while self._commands:
            commands.append(self._commands.popleft())
        return commands

    def send(self, kind: str, payload: Any) -> int:
        seq = next(self._seq)
        self._commands.append((seq, kind, payload))
        self._wake.set()
        return seq

    def stop(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)


def cpu_share(index: int, num_replicas: int) -> list[int]:
    """The CPUs replica `index` of `num_replicas` is pinned to: an equal, contiguous share of this process's CPUs
    (one each, shared round-robin, when there are more replicas than CPUs)."""
    cpus = sorted(os.sched_getaffinity(0))
    if num_replicas >= len(cpus):
        return [cpus[index % len(cpus)]]
    per = len(cpus) // num_replicas
    return cpus[index * per:(index + 1) * per]


class ProcessReplica(Replica):
    """The core in its own process (see the module docstring)."""

    can_restart = True

    def __init__(self, index: int, config: EngineConfig, cpus: list[int] | None, send_plans: bool = False,
                 kv_events: bool = True, log_level: str = "INFO", niceness: int = 0) -> None:
        super().__init__(index, config.kv_role)
        self.niceness = niceness
        self.config = config
        self.cpus = cpus
        self.send_plans = send_plans
        self.kv_events = kv_events
        self.log_level = log_level
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._dir = tempfile.mkdtemp(prefix="tokenmill-ipc-")
        self._commands: zmq.Socket | None = None
        self._reports: zmq.Socket | None = None
        self._process: Any = None
        self._closing = threading.Event()
        self._reader: threading.Thread | None = None

    def _spawn(self, options: CoreProcessOptions) -> Any:
        """Start the core's process; the handle answers is_alive(), kill(), join(timeout) and exitcode as a
        multiprocessing.Process does."""
        process = core_process_context().Process(
            target=run_engine_core, args=(self.config, options), name=f"tokenmill-core-{self.index}", daemon=True)
        process.start()
        return process

    def _bind(self, sock: zmq.Socket, name: str) -> str:
        """Bind a socket for this launch; returns the address the core connects to."""
        address = f"ipc://{self._dir}/core{self.index}-{self.generation}-{name}"
        sock.bind(address)
        return address

    def launch(self) -> CoreInfo:
        self._shut_process(timeout=5.0)
        self.generation += 1
        self._closing.clear()
        commands = self._context.socket(zmq.PUSH)
        commands.setsockopt(zmq.LINGER, 0)
        reports = self._context.socket(zmq.PULL)
        reports.setsockopt(zmq.LINGER, 0)
        self._commands, self._reports = commands, reports
        options = CoreProcessOptions(self.index, self.cpus, self._bind(commands, "in"), self._bind(reports, "out"),
                                     self.send_plans, self.kv_events, self.log_level, niceness=self.niceness,
                                     environment=dict(os.environ))
        self._process = self._spawn(options)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if reports.poll(200):
                hello = reports.recv_pyobj()
                if isinstance(hello, CoreInfo):
                    self.info = hello
                    return hello
                if isinstance(hello, CoreDeath):
                    raise RuntimeError(f"engine core {self.index} {hello.message}")
            elif not self._process_alive():
                raise RuntimeError(f"engine core {self.index} exited while starting (exit code {self._exitcode()})")
            if time.monotonic() > deadline:
                self._shut_process(timeout=0.0)
                raise RuntimeError(f"engine core {self.index} did not start within {START_TIMEOUT_S:.0f} s")

    def _process_alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def _exitcode(self) -> int | None:
        return None if self._process is None else self._process.exitcode

    def start(self, deliver: Deliver) -> None:
        self._reader = threading.Thread(target=self._read, args=(deliver, self._reports),
                                        name=f"tokenmill-core-{self.index}-reader", daemon=True)
        self._reader.start()

    def _read(self, deliver: Deliver, reports: zmq.Socket) -> None:
        while not self._closing.is_set():
            if reports.poll(100):
                deliver(reports.recv_pyobj())
            elif not self._process_alive():
                while reports.poll(0):  # what it said before it went
                    deliver(reports.recv_pyobj())
                deliver(ReplicaExit(self._exitcode()))
                return

    def send(self, kind: str, payload: Any) -> int:
        seq = next(self._seq)
        if self._commands is not None:
            try:
                self._commands.send_pyobj((seq, kind, payload), zmq.NOBLOCK)
            except zmq.Again:  # no process connected (it died): its requests are being failed anyway
                logger.warning("engine core %d is not connected; dropped a %r command", self.index, kind)
        return seq

    def kill(self) -> None:
        """SIGKILL the process (fault tests)."""
        if self._process is not None:
            self._process.kill()

    def _shut_process(self, timeout: float) -> None:
        self._closing.set()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(2.0)  # it owns the report socket until it returns
        self._reader = None
        if self._process is not None:
            self._process.join(timeout)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5.0)
            self._process = None
        for sock in (self._commands, self._reports):
            if sock is not None:
                sock.close(linger=0)
        self._commands = self._reports = None

    def stop(self, timeout: float = 10.0) -> None:
        self._closing.set()  # the reader reports no exit for a process told to go
        if self._commands is not None and self._process_alive():
            # never blocks: a core that is exiting (one that failed to start) may no longer take it, and a PUSH
            # socket without a peer would wait forever; _shut_process stops the process either way
            with contextlib.suppress(zmq.Again):
                self._commands.send_pyobj((0, "shutdown", None), zmq.NOBLOCK)
        self._shut_process(timeout)
