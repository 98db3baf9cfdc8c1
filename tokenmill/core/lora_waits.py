"""Requests under an adapter in the scheduler: one whose adapter is still being read from disk steps aside
without holding up the queue; no more than `max_loras` distinct adapters run at once (the resident slots), so
a waiting request whose adapter would be one too many lets the requests behind it go first (vLLM's rule)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Protocol

from tokenmill.core.request_queue import RequestQueue
from tokenmill.lora.request import LoRARequest
from tokenmill.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class AdapterSource(Protocol):
    """Where adapters come from (lora/cache.py: AdapterCache)."""

    def poll(self, request: LoRARequest) -> bool: ...

    def wait_for_one(self, timeout: float) -> None: ...


class LoRAWaits:
    def __init__(self, source: AdapterSource | None, max_loras: int) -> None:
        self.source = source
        self.max_loras = max_loras
        self.loading: list[Request] = []  # waiting requests whose adapter is being read
        self._unsettled: dict[str, Request] = {}  # not yet admitted, adapter not yet seen in memory

    def add(self, request: Request) -> None:
        if request.lora_request is None:
            return
        if self.source is None:
            raise ValueError("this engine serves no LoRA adapters (start it with --enable-lora)")
        self._unsettled[request.request_id] = request

    def set_aside(self, waiting: RequestQueue) -> list[Request]:
        """Take out of the queue the requests whose adapter is loading (put back by `restore`); return those whose
        adapter failed to load (logged here; the caller aborts them)."""
        self.loading = []
        failed: list[Request] = []
        for request_id, request in list(self._unsettled.items()):
            if request.status != RequestStatus.WAITING:
                del self._unsettled[request_id]
                continue
            assert self.source is not None and request.lora_request is not None
            try:
                ready = self.source.poll(request.lora_request)
            except Exception as exc:  # a checkpoint that cannot be read fails the requests that named it
                logger.error("request %s: adapter %s failed to load: %s", request_id,
                             request.lora_request.lora_name, exc)
                del self._unsettled[request_id]
                failed.append(request)
                continue
            if ready:
                del self._unsettled[request_id]
            else:
                self.loading.append(request)
        for request in self.loading + failed:
            waiting.remove(request)
        return failed

    def restore(self, waiting: RequestQueue) -> None:
        for request in reversed(self.loading):
            waiting.push_front(request)

    def admits(self, request: Request, running: Iterable[Request]) -> bool:
        """Whether `request` can join the running requests without a (max_loras + 1)-th distinct adapter."""
        lora = request.lora_request
        if lora is None:
            return True
        active = {r.lora_request.lora_int_id for r in running if r.lora_request is not None}
        return lora.lora_int_id in active or len(active) < self.max_loras

    def wait_for_one(self, timeout: float) -> None:
        if self.loading and self.source is not None:
            self.source.wait_for_one(timeout)

    def stats(self, running: Iterable[Request], waiting: Iterable[Request]) -> dict[str, Any]:
        """The SchedulerStats fields on adapters (none when the engine serves no adapters)."""
        if self.source is None:
            return {}
        return {"running_loras": _names(running), "waiting_loras": _names(waiting), "max_loras": self.max_loras}


def _names(requests: Iterable[Request]) -> list[str]:
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})
