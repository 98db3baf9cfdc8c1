"""AsyncLLM: the engine core steps in a background thread; asyncio callers stream per-request outputs.

The thread runs only schedule -> execute -> update. Tokenization happens in the HTTP handlers and
detokenization / stop strings in the event loop (the output processor), so neither stalls a model step, and a
step never waits for a client: outputs are handed to the loop with `call_soon_threadsafe`. Requests enter and
leave the core only through a command queue that the thread drains between steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from tokenmill.core.scheduler import EngineCoreOutput
from tokenmill.engine.core import ModelStepError, StepRecord
from tokenmill.engine.llm_engine import LLMEngine, PromptType
from tokenmill.outputs import RequestOutput
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill.engine")


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound: the caller should retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped for good (HTTP 503); a supervisor should restart the process."""


class EngineStepError(RuntimeError):
    """The model step this request was in raised; the request is failed (HTTP 500), the engine goes on."""


# After this many model steps in a row have raised, the executor is taken to be broken: the engine dies.
MAX_CONSECUTIVE_STEP_FAILURES = 3


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
        self._parents: dict[str, str] = {}  # engine request (one per sample) -> the request id it belongs to
        self.step_listeners: list[StepListener] = []
        self.state_listeners: list[Callable[[int, int, float], None]] = []  # after commands applied when idle
        self.fatal_listeners: list[Callable[[BaseException], None]] = []  # the engine loop died
        self.dead_error: BaseException | None = None

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
                        self._post(self._fail_requests, [child.request_id], exc)
            elif kind == "abort":
                core.abort_requests(payload)
            elif kind == "finish":
                core.finish_requests(payload, RequestStatus.FINISHED_STOPPED)

    def _run(self) -> None:
        core = self.engine.core
        failures_in_a_row = 0
        try:
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
                except ModelStepError as exc:
                    # Fault isolation: only the requests of this step fail; the rest keep their state and KV.
                    failures_in_a_row += 1
                    failed = core.fail_step(exc.plan)
                    logger.error("model step failed (%d in a row); failing its %d requests: %s",
                                 failures_in_a_row, len(failed), ", ".join(failed), exc_info=exc.__cause__)
                    error = EngineStepError(f"internal error in the model step: {exc.__cause__!r}")
                    self._post(self._fail_requests, failed, error)
                    self._post(self._on_state, *core.current_state())
                    if failures_in_a_row >= MAX_CONSECUTIVE_STEP_FAILURES:
                        raise RuntimeError(f"{failures_in_a_row} model steps in a row failed") from exc.__cause__
                    continue
                failures_in_a_row = 0
                self._post(self._on_step, outputs, core.last_step)
        except Exception as exc:  # the scheduler's state can no longer be trusted: stop, and say so
            logger.critical("engine loop died: %r", exc, exc_info=exc)
            self.dead_error = exc
            with contextlib.suppress(Exception):
                core.abort_requests(list(core.scheduler.requests))
            self._post(self._on_death, exc)

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

    def _fail_requests(self, child_ids: list[str], exc: BaseException) -> None:
        """Hand `exc` to the streams owning these engine requests (a parent fails with any of its children)."""
        for request_id in {self._parents.get(child_id) for child_id in child_ids}:
            queue = self._queues.get(request_id) if request_id is not None else None
            if queue is not None:
                queue.put_nowait(exc)

    def fail_all(self, exc: BaseException) -> None:
        """Fail every open request stream with `exc` (closing a stream aborts its engine requests)."""
        for queue in self._queues.values():
            queue.put_nowait(exc)

    def _on_death(self, exc: BaseException) -> None:
        self.fail_all(EngineDeadError(f"the engine stopped after an internal error: {exc!r}"))
        for listener in self.fatal_listeners:
            listener(exc)

    @property
    def num_open_requests(self) -> int:
        return len(self._queues)

    def num_waiting(self) -> int:
        return self.engine.core.scheduler.num_waiting + sum(1 for kind, _ in list(self._commands) if kind == "add")

    def has_request(self, request_id: str) -> bool:
        return request_id in self._queues

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None, strict_max_tokens: bool = False) -> RequestStream:
        """Validate and submit at once (raising QueueFullError / ValueError / EngineDeadError); the returned
        stream yields the outputs, and closing it before the end aborts the request."""
        if not self.is_running or self.dead_error is not None:
            raise EngineDeadError("the engine is not running")
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.num_waiting() >= self.max_waiting_requests:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting_requests} requests)")
        text, token_ids, children = self.engine.make_requests(
            request_id, prompt, params, time.monotonic() if arrival_time is None else arrival_time, priority,
            strict_max_tokens)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        self._parents.update((child.request_id, request_id) for child in children)
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
        for child in children:
            self._parents.pop(child.request_id, None)
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
