"""The decode engine's side of a transfer: fetch a request's KV and store it into its blocks in a background
thread, so decode steps go on while a long prompt's KV arrives (one stall of the whole copy otherwise).

While the engine has requests decoding, the copy goes a few blocks at a time with a pause between pieces: on a
small CPU share the copy would otherwise take half the core from the steps for as long as it lasts (measured
here, one core per engine: a 3,000-token prompt's 138 MB copied in one go stretched the short streams' steps
to 140-300 ms against 18 ms; paced, the prompt's first token comes later by about the pauses' sum).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tokenmill.kv_transfer.connector import KVConnector, KVTransferError, block_nbytes, timed_load
from tokenmill.request import Request


class BackgroundKVLoader:
    """Implements the scheduler's KVLoader with one worker thread. The executor must store blocks without
    taking the step thread's locks (ModelRunner.write_kv_blocks copies into blocks no step touches: they
    belong to a request that is not running yet, and are not in the prefix-cache index until loaded)."""

    def __init__(self, connector: KVConnector, executor: Any, busy: Callable[[], bool] = lambda: False,
                 piece_bytes: int = 3 << 20, pause_s: float = 0.015) -> None:
        """`busy`: whether steps are running (then the copy is paced: `piece_bytes` at a time, `pause_s`
        between pieces)."""
        self.connector = connector
        self.executor = executor
        self.busy = busy
        self.piece_bytes = piece_bytes
        self.pause_s = pause_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-kv-load")
        self._done: queue.SimpleQueue[tuple[str, str | None, int, float]] = queue.SimpleQueue()
        self._arrived = threading.Event()

    def start(self, request: Request, first_block: int, block_ids: list[int]) -> None:
        assert request.kv_transfer_params is not None
        self._pool.submit(self._load, request.request_id, request.kv_transfer_params, first_block, block_ids)

    def skip(self, request: Request) -> None:
        self._finish(request.request_id, None, 0, 0.0)

    def _load(self, request_id: str, params: dict[str, Any], first_block: int, block_ids: list[int]) -> None:
        per_piece = max(1, self.piece_bytes // max(1, block_nbytes(params)))
        nbytes, seconds = 0, 0.0
        try:
            for start in range(0, len(block_ids), per_piece):
                if start and self.busy():
                    time.sleep(self.pause_s)
                ids = block_ids[start:start + per_piece]
                data, took = timed_load(self.connector, params, first_block + start, first_block + start + len(ids))
                if data.shape[0] < len(ids):
                    raise KVTransferError(f"{data.shape[0]} blocks arrived, {len(ids)} needed")
                self.executor.write_kv_blocks(ids, data)
                nbytes += data.numel() * data.element_size()
                seconds += took
        except Exception as exc:  # noqa: BLE001 - any failure fails this request only
            self._finish(request_id, f"KV transfer failed: {exc}", 0, 0.0)
            return
        self._finish(request_id, None, nbytes, seconds)

    def _finish(self, request_id: str, error: str | None, nbytes: int, seconds: float) -> None:
        self._done.put((request_id, error, nbytes, seconds))
        self._arrived.set()

    def poll(self) -> list[tuple[str, str | None, int, float]]:
        done = []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                return done

    def wait(self, timeout: float) -> None:
        """Block until a load finishes (or `timeout`): a core with nothing else to do must not spin."""
        self._arrived.wait(timeout)
        self._arrived.clear()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

