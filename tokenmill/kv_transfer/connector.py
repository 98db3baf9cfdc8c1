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
import os
import socket
import struct
import tempfile
import threading
import time
import uuid
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenmill.kv_transfer.handoff import discard

logger = logging.getLogger("tokenmill.kv_transfer")

TRANSPORTS = ("shm", "tcp")
# uint8: an 8-bit cache's blocks, moved as stored (values and scales; model_runner.read_kv_blocks)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8}


class KVTransferError(RuntimeError):
    """The blocks could not be fetched (gone, timed out, corrupted)."""


@dataclass
class KVBlocks:
    """A request's KV blocks as they move: [blocks, layers, 2 (K, V), elements of one layer's block]."""

    data: torch.Tensor
    block_hashes: list[int]  # chained hashes of the full blocks among them (the prefix cache's keys)
    num_tokens: int  # prompt tokens they hold (the last block may be partly filled)

    def checksums(self) -> list[int]:
        raw = _as_bytes(self.data).data
        per_block = raw.nbytes // max(1, self.data.shape[0])
        return [zlib.crc32(raw[i * per_block:(i + 1) * per_block]) for i in range(self.data.shape[0])]


def _as_bytes(tensor: torch.Tensor) -> np.ndarray:
    return tensor.contiguous().view(torch.uint8).reshape(-1).numpy()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def block_nbytes(header: dict[str, Any]) -> int:
    """Bytes of one block as saved: [layers, 2, elements] in the header's dtype."""
    return DTYPES[header["dtype"]].itemsize * int(np.prod(header["shape"][1:]))


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
    """Engines on one host: the producer writes a request's blocks to a file in shared memory (/dev/shm), the
    consumer reads the blocks it lacks straight into its buffer, the producer unlinks the file on release."""

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        self._files: dict[str, str] = {}
        self._lock = threading.Lock()

    def save(self, request_id: str, blocks: KVBlocks) -> dict[str, Any]:
        path = os.path.join(self.directory, f"tokenmill-kv-{os.getpid()}-{uuid.uuid4().hex[:16]}")
        with open(path, "wb") as f:
            f.write(_as_bytes(blocks.data).data)
        with self._lock:
            self.release(request_id)
            self._files[request_id] = path
        return {"transport": "shm", "path": path, **_header(request_id, blocks)}

    def load(self, params: dict[str, Any], first_block: int, end_block: int | None = None) -> torch.Tensor:
        shape = list(params["shape"])
        end = shape[0] if end_block is None else min(end_block, shape[0])
        nbytes = block_nbytes(params)
        buffer = bytearray((end - first_block) * nbytes)
        try:
            with open(params["path"], "rb") as f:
                f.seek(first_block * nbytes)
                got = f.readinto(buffer)
        except FileNotFoundError as exc:
            raise KVTransferError(f"the KV of request {params['request_id']} is gone from shared memory") from exc
        if got != len(buffer):
            raise KVTransferError(f"the KV of request {params['request_id']} is truncated")
        _verify(memoryview(buffer), params["crc32"][first_block:end], nbytes, first_block)
        return torch.frombuffer(buffer, dtype=torch.uint8).view(DTYPES[params["dtype"]]).reshape(
            [end - first_block, *shape[1:]])

    def release(self, request_id: str) -> None:
        path = self._files.pop(request_id, None)
        if path is not None:
            discard(path)

    def pending(self) -> int:
        return len(self._files)

    def close(self) -> None:
        for request_id in list(self._files):
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
        nbytes = block_nbytes(header)
        if len(raw) != (end - first_block) * nbytes:
            raise KVTransferError(f"expected {end - first_block} KV blocks, got {len(raw)} bytes")
        _verify(memoryview(raw), header["crc32"][first_block:end], nbytes, first_block)
        return torch.frombuffer(raw, dtype=torch.uint8).view(DTYPES[header["dtype"]]).reshape(
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
