"""The host-memory and disk tiers behind one index, and the threads that move blocks to and from the disk.

The engine's thread calls `save` (blocks the pool is about to reuse: kept in host memory at once, queued for
the disk), `count_hits` (how far a prefix goes on in the tiers: in-memory indexes only), `start_load` and
`poll`. Disk writes and reads run on two worker threads (reads never queue behind a backlog of writes);
`poll` stores what has arrived into the pool's blocks between steps, so the step loop never waits on the disk.
"""

from __future__ import annotations

import logging
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.config import EngineConfig
from tokenmill.kv_offload.disk_tier import DiskTier
from tokenmill.kv_offload.host_tier import HostTier, TierBlock
from tokenmill.kv_offload.identity import kv_namespace
from tokenmill.model.metadata import resolve_model_path

logger = logging.getLogger(__name__)

PROBE_BYTES = 8 << 20  # the disk read-bandwidth probe at start
GIB = 1 << 30


@dataclass
class TierStats:
    """Counters since start, for /metrics and the stats line."""
    hits: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})  # blocks loaded back
    bytes_loaded: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    blocks_saved: int = 0
    bytes_written_disk: int = 0
    loads: int = 0
    load_seconds: float = 0.0
    failed_blocks: int = 0  # looked up but did not read back (removed meanwhile, corrupt)


@dataclass
class _Load:
    request_id: str
    block_ids: list[int]
    blocks: list[TierBlock | None]  # host hits filled in at start; disk ones by the reader
    disk: list[tuple[int, int, tuple[int, ...]]]  # (position, key, tokens) to read from disk
    started: float
    tiers: list[str]


class KVTierStore:
    def __init__(self, host: HostTier | None, disk: DiskTier | None,
                 write_blocks: Callable[[list[int], torch.Tensor], None]) -> None:
        self.host = host
        self.disk = disk
        self.write_blocks = write_blocks  # the model runner's write_kv_blocks
        self.stats = TierStats()
        self._done: queue.SimpleQueue[_Load] = queue.SimpleQueue()
        self._arrived = threading.Event()
        self._reads: queue.SimpleQueue[_Load | None] = queue.SimpleQueue()
        self._writes: queue.SimpleQueue[list[tuple[int, TierBlock]] | None] = queue.SimpleQueue()
        self._pending_writes = 0
        self._host_dropped: list[int] = []  # keys the host tier let go (engine thread)
        self._writes_idle = threading.Condition()
        self.disk_read_bytes_per_s = float("inf")
        if disk is not None:
            self.disk_read_bytes_per_s = probe_read_bandwidth(disk.directory)
            for name, target in (("reader", self._read_loop), ("writer", self._write_loop)):
                threading.Thread(target=target, name=f"tokenmill-kv-disk-{name}", daemon=True).start()

    # ------------------------------------------------------------------ engine thread

    def save(self, keys: list[int], token_ids: list[tuple[int, ...]], data: torch.Tensor,
             to_host: bool = True) -> None:
        """Blocks leaving the pool ([n, ...] as read_kv_blocks gives them): into host memory now (unless
        `to_host` is False: at exit), to disk in the background."""
        batch = []
        for i, (key, tokens) in enumerate(zip(keys, token_ids, strict=True)):
            block = TierBlock(tokens, data[i].clone())
            if self.host is not None and to_host:
                self._host_dropped.extend(self.host.put(key, block))
            if self.disk is not None and self.disk.writable and key not in self.disk:
                batch.append((key, block))
        self.stats.blocks_saved += len(keys)
        if batch:
            with self._writes_idle:
                self._pending_writes += 1
            self._writes.put(batch)

    def count_hits(self, keys: list[int], token_ids: list[tuple[int, ...]]) -> int:
        """How many of these consecutive blocks the tiers hold (the host's compared by tokens; the disk's by
        its index: a file's tokens are checked when it is read)."""
        count = 0
        for key, tokens in zip(keys, token_ids, strict=True):
            if not ((self.host is not None and self.host.matches(key, tokens))
                    or (self.disk is not None and key in self.disk)):
                break
            count += 1
        return count

    def load_seconds(self, keys: list[int], block_bytes: int) -> float:
        """Expected time to read these blocks back: memory copies for the host's, the disk's at its measured
        bandwidth."""
        on_disk = sum(1 for key in keys if self.host is None or key not in self.host)
        if not on_disk:
            return 0.0
        return on_disk * block_bytes / self.disk_read_bytes_per_s if self.disk_read_bytes_per_s > 0 else float("inf")

    def start_load(self, request_id: str, keys: list[int], token_ids: list[tuple[int, ...]],
                   block_ids: list[int]) -> None:
        blocks: list[TierBlock | None] = []
        disk: list[tuple[int, int, tuple[int, ...]]] = []
        tiers = []
        for position, (key, tokens) in enumerate(zip(keys, token_ids, strict=True)):
            block = self.host.get(key, tokens) if self.host is not None else None
            blocks.append(block)
            tiers.append("host" if block is not None else "disk")
            if block is None:
                disk.append((position, key, tokens))
        load = _Load(request_id, block_ids, blocks, disk, time.perf_counter(), tiers)
        if disk:
            self._reads.put(load)
        else:
            self._done.put(load)
            self._arrived.set()

    def poll(self) -> list[tuple[str, int]]:
        """Store the loads that have arrived into their blocks: (request id, leading blocks loaded) each. A
        block that did not read back ends its load there (the request computes the rest)."""
        finished: list[tuple[str, int]] = []
        while True:
            try:
                load = self._done.get_nowait()
            except queue.Empty:
                return finished
            loaded = next((i for i, block in enumerate(load.blocks) if block is None), len(load.blocks))
            self.stats.failed_blocks += len(load.blocks) - loaded
            if loaded:
                data = torch.stack([block.data for block in load.blocks[:loaded] if block is not None])
                self.write_blocks(load.block_ids[:loaded], data)
                per_block = data[0].numel() * data.element_size()
                for tier in load.tiers[:loaded]:
                    self.stats.hits[tier] += 1
                    self.stats.bytes_loaded[tier] += per_block
            self.stats.loads += 1
            self.stats.load_seconds += time.perf_counter() - load.started
            finished.append((load.request_id, loaded))

    def held_keys(self) -> list[int]:
        """Every block the tiers hold (a restarted engine announces its disk's to a cache-aware router)."""
        keys = list(self.host._blocks) if self.host is not None else []
        return keys + (self.disk.keys() if self.disk is not None else [])

    def drain_dropped(self) -> list[int]:
        """Keys no tier holds any more since the last call: a cache-aware router stops counting them. A key
        the host lets go that went to a writable disk is still held."""
        host_dropped, self._host_dropped = self._host_dropped, []
        disk = self.disk
        gone = [key for key in host_dropped if disk is None or (not disk.writable and key not in disk)]
        if disk is not None:
            gone += [key for key in disk.drain_dropped() if self.host is None or key not in self.host]
        return gone

    def counters(self) -> dict[str, float]:
        """Cumulative counters for /metrics and the stats line: blocks read back and their bytes per tier,
        loads and their seconds, blocks each tier dropped, bytes written to disk."""
        stats = self.stats
        return {"host_hits": stats.hits["host"], "disk_hits": stats.hits["disk"],
                "host_bytes": stats.bytes_loaded["host"], "disk_bytes": stats.bytes_loaded["disk"],
                "loads": stats.loads, "load_seconds": stats.load_seconds, "failed_blocks": stats.failed_blocks,
                "host_evictions": self.host.evictions if self.host is not None else 0,
                "disk_evictions": self.disk.evictions if self.disk is not None else 0,
                "disk_written_bytes": stats.bytes_written_disk}

    def wait(self, timeout: float) -> None:
        """Block until a load arrives (or `timeout`): a core with nothing else to do must not spin."""
        self._arrived.clear()
        if self._done.empty():
            self._arrived.wait(timeout)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until the queued disk writes are done (a drain before exit); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._writes_idle:
            while self._pending_writes:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._writes_idle.wait(left)
        return True

    def close(self) -> None:
        self._reads.put(None)
        self._writes.put(None)

    # ------------------------------------------------------------------ worker threads

    def _read_loop(self) -> None:
        assert self.disk is not None
        while (load := self._reads.get()) is not None:
            started = time.perf_counter()
            nbytes = 0
            for position, key, tokens in load.disk:
                block = self.disk.get(key, tokens)
                if block is None:
                    break  # the blocks after it would be of no use: a prefix must be whole
                load.blocks[position] = block
                nbytes += block.nbytes
            took = time.perf_counter() - started
            if nbytes and took > 0:  # the bandwidth the cost rule uses follows what the disk gives
                observed = nbytes / took
                self.disk_read_bytes_per_s = 0.7 * self.disk_read_bytes_per_s + 0.3 * observed
            self._done.put(load)
            self._arrived.set()

    def _write_loop(self) -> None:
        assert self.disk is not None
        while (batch := self._writes.get()) is not None:
            for key, block in batch:
                if self.disk.put(key, block):
                    self.stats.bytes_written_disk += block.nbytes
            with self._writes_idle:
                self._pending_writes -= 1
                self._writes_idle.notify_all()


def probe_read_bandwidth(directory: os.PathLike[str] | str) -> float:
    """Bytes/s a fresh file in `directory` reads back at (written, synced, read once): the starting point of
    the load-or-recompute rule, refined by every load. A failure says 0 (never load from that disk)."""
    try:
        payload = os.urandom(PROBE_BYTES)
        with tempfile.NamedTemporaryFile(dir=directory, suffix=".tmp") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
            started = time.perf_counter()
            with open(f.name, "rb") as reader:
                reader.read()
            took = time.perf_counter() - started
        return PROBE_BYTES / max(took, 1e-6)
    except OSError as exc:
        logger.warning("KV disk tier: probing %s failed (%s)", directory, exc)
        return 0.0


def open_tier_store(config: EngineConfig, executor: Any) -> KVTierStore | None:
    """The tiers `config` asks for over this executor's KV blocks; None when it asks for none."""
    if not (config.kv_offload_memory_gb or config.kv_cache_dir):
        return None
    if not all(hasattr(executor, name) for name in ("read_kv_blocks", "write_kv_blocks", "kv_identity")):
        raise ValueError("the KV tiers need an executor that reads and writes KV blocks (the model runner)")
    host = HostTier(int(config.kv_offload_memory_gb * GIB)) if config.kv_offload_memory_gb else None
    disk = None
    if config.kv_cache_dir:
        namespace = kv_namespace(resolve_model_path(config.model), executor.kv_identity())
        disk = DiskTier(config.kv_cache_dir, namespace, int(config.kv_cache_dir_size_gb * GIB))
    store = KVTierStore(host, disk, executor.write_kv_blocks)
    logger.info("KV tiers: host memory %s; disk %s", f"{config.kv_offload_memory_gb:g} GB" if host else "off",
                "off" if disk is None else
                f"{disk.directory} ({len(disk)} blocks, {disk.used_bytes / GIB:.2f} of {config.kv_cache_dir_size_gb:g} "
                f"GB; reads at {store.disk_read_bytes_per_s / 1e9:.2f} GB/s)")
    return store
