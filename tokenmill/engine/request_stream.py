"""One request's outputs as an async iterator, from the front end's queue for it (engine/async_engine.py)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from tokenmill.outputs import RequestOutput
from tokenmill.request import Request

if TYPE_CHECKING:
    from tokenmill.engine.async_engine import AsyncLLM


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
