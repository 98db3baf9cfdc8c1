"""A GGUF file read once: its metadata as Python values and its tensors as views into one memory map.

The `gguf` package's `GGUFReader` builds a numpy view per field part, which takes 10-25 s on a 262k-token
vocabulary (Gemma 3) before any weight is read; this reader walks the header with `struct` and keeps plain
values (about 0.5 s there). Tensor data stays in the map, shaped as `GGUFReader` shapes it (quantized types as
bytes per row), so `gguf.quants.dequantize` reads it unchanged. Format: https://github.com/ggml-org/ggml
(docs/gguf.md); type sizes come from the `gguf` package.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# value type -> (struct format, numpy dtype) of the scalar types
_SCALARS: dict[int, tuple[str, Any]] = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16), 4: ("<I", np.uint32),
    5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_), 10: ("<Q", np.uint64), 11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9
NUMPY_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                GGMLQuantizationType.I64: np.int64}


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: innermost dimension first
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # a view into the file's map: [outer dims..., inner elements or bytes]


class GGUFStrings(Sequence[str]):
    """A string array of the header (a vocabulary, merges) decoded one item at a time when read: most starts
    read a few items of a 150k-262k token vocabulary, and decoding all of them took ~0.3 s per process."""

    def __init__(self, buffer: memoryview, starts: list[int]) -> None:
        self._buffer = buffer
        self._starts = starts  # offset of each item's 8-byte length

    def __len__(self) -> int:
        return len(self._starts)

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self._item(i) for i in range(*index.indices(len(self)))]
        return self._item(range(len(self))[index])

    def _item(self, i: int) -> str:
        start = self._starts[i]
        (length,) = struct.unpack_from("<Q", self._buffer, start)
        return bytes(self._buffer[start + 8:start + 8 + length]).decode("utf-8", errors="replace")

    def __iter__(self) -> Any:
        return (self._item(i) for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (list, tuple, GGUFStrings)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # a list's behaviour


class GGUFFile:
    def __init__(self, path: str) -> None:
        self.path = path
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        buffer = self._map.data  # a memoryview of the whole file
        if bytes(buffer[:4]) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buffer, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or newer)")
        self._buffer, self._offset = buffer, 24
        self.fields: dict[str, Any] = {}
        self._spans: dict[str, tuple[int, int]] = {}  # each field's value: its bytes in the header
        for _ in range(n_kv):
            key = self._string()
            (kind,) = self._unpack("<I")
            begin = self._offset
            self.fields[key] = self._value(kind)
            self._spans[key] = (begin, self._offset)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            kind, offset = self._unpack("<IQ")
            infos.append((name, tuple(int(d) for d in dims), GGMLQuantizationType(kind), offset))
        alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(name, dims, kind, start + offset) for name, dims, kind, offset in infos]
        self._header = buffer[:self._offset]
        del self._buffer

    def field_bytes(self, key: str) -> bytes:
        """A field's value as stored (type tag excluded): what a cache keys on without decoding it."""
        begin, end = self._spans[key]
        return bytes(self._header[begin:end])

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._buffer, self._offset)
        self._offset += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = struct.unpack_from("<Q", self._buffer, self._offset)
        start = self._offset + 8
        self._offset = start + length
        return bytes(self._buffer[start:self._offset]).decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item_kind, count = self._unpack("<IQ")
            if item_kind == _STRING:
                starts, offset, buffer = [], self._offset, self._buffer
                for _ in range(count):
                    starts.append(offset)
                    offset += 8 + struct.unpack_from("<Q", buffer, offset)[0]
                self._offset = offset
                return GGUFStrings(buffer, starts)
            if item_kind == _ARRAY:
                return [self._value(_ARRAY) for _ in range(count)]
            dtype = np.dtype(_SCALARS[item_kind][1])
            values = np.frombuffer(self._buffer, dtype=dtype, count=count, offset=self._offset)
            self._offset += count * dtype.itemsize
            return values.tolist()
        (value,) = self._unpack(_SCALARS[kind][0])
        return value

    def _tensor(self, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType, offset: int) -> GGUFTensor:
        shape = tuple(reversed(dims))  # numpy order: outermost first
        if kind in NUMPY_TYPES:
            dtype = np.dtype(NUMPY_TYPES[kind])
            count = int(np.prod(shape))
            data = self._map[offset:offset + count * dtype.itemsize].view(dtype).reshape(shape)
        else:
            byte_shape = quant_shape_to_byte_shape(shape, kind)
            block, size = GGML_QUANT_SIZES[kind]
            count = int(np.prod(shape)) // block * size
            data = self._map[offset:offset + count].reshape(byte_shape)
        return GGUFTensor(name, dims, kind, data)

    def release(self, tensor: GGUFTensor) -> None:
        """Drop the tensor's pages from this process's memory once it has been converted (they are clean file
        pages: a later read faults them in again). Without it the whole file stays resident after loading."""
        raw = getattr(self._map, "_mmap", None)
        if raw is None or not hasattr(raw, "madvise"):
            return
        page = mmap.PAGESIZE
        begin = tensor.data.ctypes.data - self._map.ctypes.data
        first, last = -(-begin // page) * page, (begin + tensor.data.nbytes) // page * page
        if last > first:
            raw.madvise(mmap.MADV_DONTNEED, first, last - first)
