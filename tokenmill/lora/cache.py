"""Adapters read from disk and kept in host memory (`--max-cpu-loras`, least recently used out first).

Reading a checkpoint happens on a background thread: a request whose adapter is still loading waits in the
queue (the scheduler sets it aside, core/lora_waits.py) while the others run; a checkpoint that fails to load
fails only the requests that named it."""

from __future__ import annotations

import concurrent.futures
import logging
from collections import OrderedDict
from collections.abc import Callable

from tokenmill.lora.adapter import LoRAAdapter
from tokenmill.lora.request import LoRARequest

logger = logging.getLogger(__name__)

Loader = Callable[[LoRARequest], LoRAAdapter]


class AdapterCache:
    def __init__(self, capacity: int, loader: Loader) -> None:
        if capacity < 1:
            raise ValueError(f"max_cpu_loras must be >= 1, got {capacity}")
        self.capacity = capacity
        self.loader = loader
        self._ready: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._pending: dict[int, concurrent.futures.Future[LoRAAdapter]] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self.disk_loads = 0

    def poll(self, request: LoRARequest) -> bool:
        """Whether the adapter is in memory; starts reading it if not. Raises what the read raised (once)."""
        lora_id = request.lora_int_id
        if lora_id in self._ready:
            return True
        future = self._pending.get(lora_id)
        if future is None:
            self._pending[lora_id] = self._pool.submit(self._read, request)
            return False
        if not future.done():
            return False
        del self._pending[lora_id]
        self._store(future.result())  # raises the load's error
        return True

    def get(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter, read now (blocking) if it is not in memory."""
        adapter = self._ready.get(request.lora_int_id)
        if adapter is not None:
            self._ready.move_to_end(request.lora_int_id)
            return adapter
        future = self._pending.pop(request.lora_int_id, None)
        adapter = future.result() if future is not None else self._read(request)
        self._store(adapter)
        return adapter

    def _read(self, request: LoRARequest) -> LoRAAdapter:
        self.disk_loads += 1
        return self.loader(request)

    def _store(self, adapter: LoRAAdapter) -> None:
        self._ready[adapter.request.lora_int_id] = adapter
        self._ready.move_to_end(adapter.request.lora_int_id)
        while len(self._ready) > self.capacity:
            evicted, _ = self._ready.popitem(last=False)
            logger.info("adapter %d left the CPU cache (--max-cpu-loras %d)", evicted, self.capacity)

    def remove(self, lora_int_id: int) -> None:
        self._ready.pop(lora_int_id, None)
        self._pending.pop(lora_int_id, None)

    def wait_for_one(self, timeout: float) -> None:
        """Nothing else to run: block until a pending read finishes (or `timeout`), rather than spin."""
        if self._pending:
            concurrent.futures.wait(list(self._pending.values()), timeout, concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
