"""Process lifecycle under a supervisor: graceful drain on SIGTERM or SIGINT, non-zero exit when the engine dies."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from types import FrameType
from typing import Protocol

import uvicorn

from tokenmill.server.middleware import ServerState

logger = logging.getLogger("tokenmill.server")


class FrontEnd(Protocol):
    """What the lifecycle needs of what it serves: one model's front end, or a pool of them."""

    fatal_listeners: list[Callable[[BaseException], None]]

    @property
    def num_open_requests(self) -> int: ...

    def fail_all(self, exc: BaseException) -> None: ...


class ShuttingDownError(RuntimeError):
    """The server stopped before this request finished (HTTP 503)."""


class GracefulServer(uvicorn.Server):
    """uvicorn, except that SIGTERM and SIGINT drain: the gate answers 503 to new API requests (and /health to
    load balancers), in-flight requests run to their end for up to `shutdown_timeout` seconds, what is left is
    then failed with a clear error, and the process exits 0. However the signal is delivered (to this process
    alone, to its whole process group as systemd and `kill -- -PGID` do, or repeated by an impatient
    supervisor), the drain goes on: the engine-core processes and their fork server ignore SIGTERM and SIGINT
    and go when this process stops them. Only a second SIGINT (Ctrl-C twice at a terminal) cuts the drain
    short. uvicorn alone would close the listening socket at once, so clients would see refused connections."""

    def __init__(self, config: uvicorn.Config, state: ServerState, llm: FrontEnd, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.llm = llm
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None
        self._cut_short = False

    async def startup(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        self._loop = asyncio.get_running_loop()
        self.llm.fatal_listeners.append(self._on_engine_death)
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self.should_exit or sig not in (signal.SIGTERM, signal.SIGINT):
            super().handle_exit(sig, frame)
        elif not self.state.draining:
            self.state.draining = True
            self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)
        elif sig == signal.SIGINT:
            self._cut_short = True
        # a SIGTERM while draining (a supervisor repeating itself, or the group's signal after our own): the
        # drain goes on

    def _start_drain(self, signal_name: str) -> None:
        self._drain = asyncio.ensure_future(self.drain(signal_name))

    async def drain(self, signal_name: str = "SIGTERM") -> None:
        loop = asyncio.get_running_loop()
        logger.info("%s: draining %d in-flight requests (up to %.0f s)", signal_name, self.state.in_flight,
                    self.shutdown_timeout)
        deadline = loop.time() + self.shutdown_timeout
        while self.state.in_flight and loop.time() < deadline and not self._cut_short:
            await asyncio.sleep(0.05)
        if self.llm.num_open_requests:
            logger.warning("%s: aborting %d unfinished requests",
                           "second SIGINT" if self._cut_short else "shutdown timeout", self.llm.num_open_requests)
            self.llm.fail_all(ShuttingDownError("the server shut down before the request finished"))
        # Let the handlers write their last bytes (bounded: a stalled client must not hold the exit).
        flush_deadline = loop.time() + 5.0
        while self.state.in_flight and loop.time() < flush_deadline:
            await asyncio.sleep(0.05)
        logger.info("drained; exiting")
        self.should_exit = True

    def _on_engine_death(self, exc: BaseException) -> None:
        logger.critical("the engine died (%r): exiting with status 1 so that a supervisor restarts the server", exc)
        self.state.exit_code = 1
        self.state.draining = True
        # Give the failed requests a moment to receive their error bodies, then stop.
        if self._loop is not None:
            self._loop.call_later(1.0, setattr, self, "should_exit", True)
