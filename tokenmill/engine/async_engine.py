"""AsyncLLM: the engine core steps in a background thread; asyncio callers stream per-request outputs.

The thread runs only schedule -> execute -> update. Tokenization happens in the HTTP handlers and
detokenization / stop strings in the event loop (the output processor), so neither stalls a model step, and a
step never waits for a client: outputs are handed to the loop with `call_soon_threadsafe`. Requests enter and
leave the core only through a command queue that the thread drains between steps.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from tokenmill.core.scheduler import EngineCoreOutput
from tokenmill.engine.core import StepRecord
from tokenmill.engine.llm_engine import LLMEngine, PromptType
from tokenmill.outputs import RequestOutput
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill.engine")


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound: the caller should retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    pass


StepListener = Callable[[StepRecord], None]


class AsyncLLM:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests or engine.config.max_waiting_requests
        self._commands: deque[tuple[str, Any]] = deque()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self.step_listeners: list[StepListener] = []
        self.state_listeners: list[Callable[[int, int, float], None]] = []  # after commands applied when idle

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ engine thread

    def _send(self, kind: str, payload: Any) -> None:
        self._commands.append((kind, payload))
        self._wake.set()

    def _apply_commands(self) -> None:
        core = self.engine.core
        while self._commands:
            kind, payload = self._commands.popleft()
            if kind == "add":
                for child in payload:
                    try:
                        core.add_request(child)
                    except ValueError as exc:  # checked before sending; only a race could get here
                        self._post(self._fail_request, child.request_id, exc)
            elif kind == "abort":
                core.abort_requests(payload)
            elif kind == "finish":
                core.finish_requests(payload, RequestStatus.FINISHED_STOPPED)

    def _run(self) -> None:
        core = self.engine.core
        while not self._stop:
            if self._commands:
                self._apply_commands()
                self._post(self._on_state, *core.current_state())
            if not core.has_unfinished_requests():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outputs = core.step()
            except Exception as exc:  # a bug must not kill the loop silently: fail in-flight requests, go on
                logger.exception("engine step failed")
                core.abort_requests(list(core.scheduler.requests))
                self._post(self._fail_all, exc)
                continue
            self._post(self._on_step, outputs, core.last_step)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    # ------------------------------------------------------------------ event loop side

    def _on_step(self, core_outputs: list[EngineCoreOutput], record: StepRecord | None) -> None:
        outputs, stopped = self.engine.output_processor.process(core_outputs)
        if stopped:
            self._send("finish", stopped)
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)
        if record is not None:
            for listener in self.step_listeners:
                listener(record)

    def _on_state(self, running: int, waiting: int, kv_usage: float) -> None:
        for listener in self.state_listeners:
            listener(running, waiting, kv_usage)

    def _fail_request(self, child_id: str, exc: BaseException) -> None:
        for request_id, queue in self._queues.items():
            if child_id == request_id or child_id.startswith(request_id + "#"):
                queue.put_nowait(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(f"engine step failed: {exc!r}"))

    def num_waiting(self) -> int:
        return self.engine.core.scheduler.num_waiting + sum(1 for kind, _ in list(self._commands) if kind == "add")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None) -> RequestStream:
        """Validate and submit at once (raising QueueFullError / ValueError / EngineDeadError); the returned
        stream yields the outputs, and closing it before the end aborts the request."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.num_waiting() >= self.max_waiting_requests:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting_requests} requests)")
        text, token_ids, children = self.engine.make_requests(
            request_id, prompt, params, time.monotonic() if arrival_time is None else arrival_time, priority)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        self.engine.output_processor.add(request_id, text, token_ids, children)
        self._send("add", children)
        return RequestStream(self, request_id, children, queue)

    async def generate(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        stream = self.add_request(request_id, prompt, params, priority)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def _release(self, request_id: str, children: list[Request], finished: bool) -> None:
        self._queues.pop(request_id, None)
        if not finished:
            self.abort(request_id, children)

    def abort(self, request_id: str, children: list[Request] | None = None) -> None:
        ids = [c.request_id for c in children] if children else self.engine.output_processor.child_ids(request_id)
        self.engine.output_processor.abort(request_id)
        self._send("abort", ids)


class RequestStream:
    """Async iterator over one request's outputs; `close()` before the end aborts the request."""

    def __init__(self, llm: AsyncLLM, request_id: str, children: list[Request],
                 queue: asyncio.Queue[RequestOutput | BaseException]) -> None:
        self.llm = llm
        self.request_id = request_id
        self.children = children
        self._queue = queue
        self._finished = False
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished or self._closed:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.finished:
            self._finished = True
            self.close()
        return item

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.llm._release(self.request_id, self.children, self._finished)
