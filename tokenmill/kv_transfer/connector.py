"""KV connectors: move a request's computed KV blocks from the engine that computed them (the producer, a
prefill engine) to another engine (the consumer, a decode engine).

The interface is three calls, and nothing in the scheduler depends on how they are carried out:
- producer: `save(request_id, blocks)` when the prompt is done, returning the parameters a consumer needs to
  fetch them (they travel with the request, as vLLM's `kv_transfer_params`), and `release(request_id)` once the
  consumer has them or the request is gone;
- consumer: `load(params, first_block, end_block)`, the blocks it lacks (the ones before `first_block` are
  already in its prefix cache), verified, or a `KVTransferError`.

Two transports: shared memory for engines on one host, TCP for engines on different hosts (length-prefixed
frames with a CRC32 per block, timeouts). A GPU transport (NIXL, NCCL) would implement the same three calls.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
import uuid
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("tokenmill.kv_transfer")

TRANSPORTS = ("shm", "tcp")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVTransferError(RuntimeError):
    """The blocks could not be fetched (gone, timed out, corrupted)."""


@dataclass
class KVBlocks:
    """A request's KV blocks as they move: [blocks, layers, 2 (K, V), elements of one layer's block]."""

    data: torch.Tensor
    block_hashes: list[int]  # chained hashes of the full blocks among them (the prefix cache's keys)
    num_tokens: int  # prompt tokens they hold (the last block may be partly filled)

    def checksums(self) -> list[int]:
        raw = memoryview(_as_bytes(self.data))
        per_block = raw.nbytes // max(1, self.data.shape[0])
        return [zlib.crc32(raw[i * per_block:(i + 1) * per_block]) for i in range(self.data.shape[0])]


def _as_bytes(tensor: torch.Tensor) -> np.ndarray:
    return tensor.contiguous().view(torch.uint8).reshape(-1).numpy()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _from_bytes(raw: bytes | memoryview, dtype: str, shape: list[int]) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(_DTYPES[dtype]).reshape(shape)


def _verify(raw: memoryview | bytes, checksums: list[int], block_nbytes: int, first_block: int) -> None:
    for i, expected in enumerate(checksums):
        if zlib.crc32(raw[i * block_nbytes:(i + 1) * block_nbytes]) != expected:
            raise KVTransferError(f"KV block {first_block + i} failed its checksum")


class KVConnector(ABC):
    @abstractmethod
    def save(self, request_id: str, blocks: KVBlocks) -> dict[str, Any]:
        """Producer: keep the blocks for a consumer; returns the parameters that fetch them."""

    @abstractmethod
    def load(self, params: dict[str, Any], first_block: int, end_block: int | None = None) -> torch.Tensor:
        """Consumer: blocks [first_block:end_block] of a saved request, verified."""

    @abstractmethod
    def release(self, request_id: str) -> None:
        """Producer: drop what was saved for the request (consumed, aborted or expired)."""

    def pending(self) -> int:
        """Saved requests not yet released."""
        return 0

    def close(self) -> None:  # noqa: B027 - optional: a transport with nothing to let go does nothing
        """Release everything."""


def _header(request_id: str, blocks: KVBlocks) -> dict[str, Any]:
    return {"request_id": request_id, "dtype": _dtype_name(blocks.data.dtype), "shape": list(blocks.data.shape),
            "block_hashes": blocks.block_hashes, "num_tokens": blocks.num_tokens, "crc32": blocks.checksums()}


class SharedMemoryConnector(KVConnector):
    """Engines on one host: the producer writes a request's blocks into a named shared-memory segment, the
    consumer copies the blocks it lacks out of it. The producer unlinks the segment on release."""

    def __init__(self) -> None:
        self._segments: dict[str, shared_memory.SharedMemory] = {}
        self._lock = threading.Lock()

    def save(self, request_id: str, blocks: KVBlocks) -> dict[str, Any]:
        raw = _as_bytes(blocks.data)
        segment = shared_memory.SharedMemory(name=f"tmkv-{uuid.uuid4().hex[:16]}", create=True,
                                             size=max(1, raw.nbytes))
        buffer = segment.buf
        assert buffer is not None
        np.frombuffer(buffer, dtype=np.uint8, count=raw.nbytes)[:] = raw
        with self._lock:
            self.release(request_id)
            self._segments[request_id] = segment
        return {"transport": "shm", "segment": segment.name, **_header(request_id, blocks)}

    def load(self, params: dict[str, Any], first_block: int, end_block: int | None = None) -> torch.Tensor:
        shape = list(params["shape"])
        end = shape[0] if end_block is None else min(end_block, shape[0])
        try:
            segment = shared_memory.SharedMemory(name=params["segment"])
        except FileNotFoundError as exc:
            raise KVTransferError(f"the KV of request {params['request_id']} is gone from shared memory") from exc
        # Attaching registers the segment with this process's resource tracker, which would unlink it when
        # this process exits: the producer owns it.
        resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
        try:
            block_nbytes = _DTYPES[params["dtype"]].itemsize * int(np.prod(shape[1:]))
            buffer = segment.buf
            assert buffer is not None
            raw = buffer[first_block * block_nbytes:end * block_nbytes]
            _verify(raw, params["crc32"][first_block:end], block_nbytes, first_block)
            tensor = _from_bytes(raw, params["dtype"], [end - first_block, *shape[1:]])
            del raw, buffer
        finally:
            segment.close()
        return tensor

    def release(self, request_id: str) -> None:
        segment = self._segments.pop(request_id, None)
        if segment is not None:
            segment.close()
            segment.unlink()

    def pending(self) -> int:
        return len(self._segments)

    def close(self) -> None:
        for request_id in list(self._segments):
            self.release(request_id)


_FRAME = struct.Struct("!QI")  # payload length, CRC32 of the payload


def _send_frame(sock: socket.socket, payload: bytes | memoryview) -> None:
    sock.sendall(_FRAME.pack(len(payload), zlib.crc32(payload)))
    sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buffer = bytearray(n)
    view = memoryview(buffer)
    got = 0
    while got < n:
        chunk = sock.recv_into(view[got:], n - got)
        if chunk == 0:
            raise KVTransferError("the KV server closed the connection mid-frame")
        got += chunk
    return buffer


def _recv_frame(sock: socket.socket, limit: int = 1 << 34) -> bytearray:
    length, crc = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    if length > limit:
        raise KVTransferError(f"a KV frame claims {length} bytes")
    payload = _recv_exact(sock, length)
    if zlib.crc32(payload) != crc:
        raise KVTransferError("a KV frame failed its checksum")
    return payload


class TCPConnector(KVConnector):
    """Engines on different hosts: the producer serves its saved blocks on a TCP port; the consumer asks for a
    request's blocks from a given one on and gets a header frame and a data frame (each length-prefixed with a
    CRC32; the header also carries a CRC32 per block)."""

    def __init__(self, serve: bool = True, host: str = "0.0.0.0", advertise_host: str | None = None,
                 timeout: float = 10.0) -> None:
        """`serve`: a producer listens for consumers (a consumer only connects)."""
        self.timeout = timeout
        self._saved: dict[str, tuple[dict[str, Any], bytes]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._server: socket.socket | None = None
        self.address = ("", 0)
        if serve:
            self._server = socket.create_server((host, 0))
            self._server.settimeout(0.5)
            self.address = (advertise_host or _local_address(), self._server.getsockname()[1])
            threading.Thread(target=self._serve, args=(self._server,), name="tokenmill-kv-server",
                             daemon=True).start()

    def save(self, request_id: str, blocks: KVBlocks) -> dict[str, Any]:
        header = _header(request_id, blocks)
        with self._lock:
            self._saved[request_id] = (header, _as_bytes(blocks.data).tobytes())
        return {"transport": "tcp", "host": self.address[0], "port": self.address[1], **header}

    def _serve(self, server: socket.socket) -> None:
        while not self._closed:
            try:
                conn, _ = server.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(self.timeout)
            try:
                ask = json.loads(_recv_frame(conn, limit=1 << 16))
                with self._lock:
                    saved = self._saved.get(ask["request_id"])
                if saved is None:
                    _send_frame(conn, json.dumps({"error": "unknown request"}).encode())
                    return
                header, raw = saved
                block_nbytes = len(raw) // max(1, header["shape"][0])
                _send_frame(conn, json.dumps(header).encode())
                end = min(int(ask["end_block"]), header["shape"][0])
                _send_frame(conn, memoryview(raw)[int(ask["first_block"]) * block_nbytes:end * block_nbytes])
            except (OSError, KVTransferError, ValueError) as exc:
                logger.warning("KV server: a transfer failed: %r", exc)

    def load(self, params: dict[str, Any], first_block: int, end_block: int | None = None) -> torch.Tensor:
        end = params["shape"][0] if end_block is None else min(end_block, params["shape"][0])
        try:
            with socket.create_connection((params["host"], params["port"]), timeout=self.timeout) as sock:
                sock.settimeout(self.timeout)
                _send_frame(sock, json.dumps({"request_id": params["request_id"], "first_block": first_block,
                                              "end_block": end}).encode())
                header = json.loads(_recv_frame(sock, limit=1 << 24))
                if "error" in header:
                    raise KVTransferError(f"the producer has no KV for request {params['request_id']}")
                raw = _recv_frame(sock)
        except (OSError, ValueError) as exc:
            raise KVTransferError(f"fetching the KV of request {params['request_id']} failed: {exc!r}") from exc
        shape = list(header["shape"])
        block_nbytes = _DTYPES[header["dtype"]].itemsize * int(np.prod(shape[1:]))
        if len(raw) != (end - first_block) * block_nbytes:
            raise KVTransferError(f"expected {end - first_block} KV blocks, got {len(raw)} bytes")
        _verify(memoryview(raw), header["crc32"][first_block:end], block_nbytes, first_block)
        return torch.frombuffer(raw, dtype=torch.uint8).view(_DTYPES[header["dtype"]]).reshape(
            [end - first_block, *shape[1:]])

    def release(self, request_id: str) -> None:
        with self._lock:
            self._saved.pop(request_id, None)

    def pending(self) -> int:
        return len(self._saved)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            self._saved.clear()
        if self._server is not None:
            self._server.close()


def _local_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def make_connector(transport: str, serve: bool = True) -> KVConnector:
    """`serve`: the producer's side (a TCP producer listens for consumers)."""
    if transport == "shm":
        return SharedMemoryConnector()
    if transport == "tcp":
        return TCPConnector(serve=serve)
    raise ValueError(f"unknown KV transport {transport!r}: one of {', '.join(TRANSPORTS)}")


def timed_load(connector: KVConnector, params: dict[str, Any], first_block: int,
               end_block: int | None = None) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    data = connector.load(params, first_block, end_block)
    return data, time.perf_counter() - start
