"""The disk tier: prefix blocks as files under `--kv-cache-dir`, kept across restarts.

One file a block, `<dir>/<namespace>/<key>.kv`: a magic, a JSON header (key, token ids, dtype, shape), the
block's bytes, and a BLAKE2b digest of all of it. The namespace (identity.py) names the model file and
everything else the KV depends on, so a block of another model or configuration is never looked at.

- Writes go to a temporary file renamed into place (atomic on POSIX): a reader, in this process or in another
  server on the same directory, sees a whole file or none. A failed write (disk full, quota, permissions) stops
  the tier's writes for good; serving goes on.
- A file that does not read back (truncated, corrupt, another key or other tokens) is removed, never served.
- Least recently used out first: the index orders files by last use (restored from their mtimes at start; a
  read touches the file) and removes the oldest past `capacity_bytes`.

Every method that touches the disk runs on the tier store's worker threads (store.py), never on the step
loop; `contains` reads only the in-memory index.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch

from tokenmill.kv_offload.host_tier import TierBlock

logger = logging.getLogger(__name__)

MAGIC = b"TMKV\x01"
DIGEST_BYTES = 32
STALE_TEMP_S = 3600.0  # a temporary file this old was left by a crash (a live writer renames within seconds)


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for part in parts:
        h.update(part)
    return h.digest()


def _file_name(key: int) -> str:
    return f"{key & 0xFFFFFFFFFFFFFFFF:016x}.kv"


def encode_block(key: int, block: TierBlock) -> bytes:
    data = block.data.contiguous()
    header = json.dumps({"key": key, "tokens": list(block.token_ids), "dtype": str(data.dtype).removeprefix("torch."),
                         "shape": list(data.shape)}).encode()
    payload = data.view(torch.uint8).numpy().tobytes() if data.numel() else b""
    body = MAGIC + struct.pack("<I", len(header)) + header + payload
    return body + _digest(body)


def decode_block(raw: bytes, key: int, token_ids: tuple[int, ...]) -> TierBlock | None:
    """The block in `raw`, or None when it is not a whole, intact file of this key and these tokens."""
    if len(raw) < len(MAGIC) + 4 + DIGEST_BYTES or not raw.startswith(MAGIC):
        return None
    body, digest = raw[:-DIGEST_BYTES], raw[-DIGEST_BYTES:]
    if _digest(body) != digest:
        return None
    (header_len,) = struct.unpack_from("<I", body, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        header = json.loads(body[start:start + header_len])
        dtype = getattr(torch, header["dtype"])
        shape = tuple(header["shape"])
    except (ValueError, KeyError, AttributeError, TypeError):
        return None
    if header.get("key") != key or tuple(header.get("tokens", ())) != token_ids:
        return None
    payload = bytearray(body[start + header_len:])
    if not isinstance(dtype, torch.dtype) or len(payload) != torch.Size(shape).numel() * dtype.itemsize:
        return None
    data = torch.frombuffer(payload, dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    return TierBlock(token_ids, data.view(dtype).reshape(shape))


class DiskTier:
    def __init__(self, root: str | Path, namespace: str, capacity_bytes: int) -> None:
        self.directory = Path(root) / namespace
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.writable = True
        self.used_bytes = 0
        self.evictions = 0
        self.corrupt_removed = 0
        self.dropped: list[int] = []  # keys evicted or removed since the owner last drained them
        self._lock = threading.Lock()  # the index: written by the workers, read by the step loop
        self._index: OrderedDict[int, int] = OrderedDict()  # key -> file bytes; front: least recently used
        self._scan()

    def _scan(self) -> None:
        """Index the files a previous run (or another server) left, oldest use first; drop stale temporaries."""
        found = []
        now = time.time()
        for entry in os.scandir(self.directory):
            try:
                stat = entry.stat()
            except FileNotFoundError:
                continue
            if entry.name.endswith(".tmp"):
                if now - stat.st_mtime > STALE_TEMP_S:
                    self._unlink(Path(entry.path))
                continue
            if not entry.name.endswith(".kv"):
                continue
            try:
                key = int(entry.name[:-3], 16)
            except ValueError:
                continue
            key = key - (1 << 64) if key >= 1 << 63 else key  # the signed hash the pool uses
            found.append((stat.st_mtime, key, stat.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self.used_bytes += size

    def __contains__(self, key: int) -> bool:
        with self._lock:
            return key in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def keys(self) -> list[int]:
        with self._lock:
            return list(self._index)

    def drain_dropped(self) -> list[int]:
        with self._lock:
            dropped, self.dropped = self.dropped, []
        return dropped

    def _path(self, key: int) -> Path:
        return self.directory / _file_name(key)

    @staticmethod
    def _unlink(path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):  # another server removed it first
            path.unlink()

    def put(self, key: int, block: TierBlock) -> bool:
        """Write one block (worker thread); False when the tier does not take it (full disk, or stopped)."""
        if not self.writable:
            return False
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
        raw = encode_block(key, block)
        temporary = self.directory / f".{_file_name(key)}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(temporary, "wb") as f:
                f.write(raw)
            os.replace(temporary, self._path(key))
        except OSError as exc:
            self._unlink(temporary)
            self.writable = False
            logger.warning("KV disk tier %s: write failed (%s); no more writes to it, serving goes on",
                           self.directory, exc)
            return False
        with self._lock:
            self._index[key] = len(raw)
            self.used_bytes += len(raw)
            victims = []
            while self.used_bytes > self.capacity_bytes and len(self._index) > 1:
                victim, size = self._index.popitem(last=False)
                self.used_bytes -= size
                self.evictions += 1
                victims.append(victim)
            self.dropped.extend(victims)
        for victim in victims:
            self._unlink(self._path(victim))
        return True

    def get(self, key: int, token_ids: tuple[int, ...]) -> TierBlock | None:
        """Read one block back (worker thread); a file that does not check out is removed."""
        path = self._path(key)
        try:
            raw = path.read_bytes()
        except OSError:
            self._forget(key)
            return None
        block = decode_block(raw, key, token_ids)
        if block is None:
            logger.warning("KV disk tier: %s is truncated, corrupt or not this prefix's; removed", path.name)
            self.corrupt_removed += 1
            self._forget(key)
            self._unlink(path)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # its last use, for the order after a restart
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        return block

    def _forget(self, key: int) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.used_bytes -= size
                self.dropped.append(key)
