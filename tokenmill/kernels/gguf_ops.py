"""GGUF blocks as stored (kernels/gguf_blocks.c, gguf_matmul.c, gguf_panels.c): decoding to float32 or int8
rows, row gathers, the row-at-a-time matmul and the row-panel GEMM (AVX512-VNNI or AVX2)."""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from tokenmill.kernels.build import I64, PTR, load_function, load_library
from tokenmill.kernels.int8_ops import int8_grouped_available, quantize_groups


@functools.cache
def _gguf_fns() -> tuple[ctypes._CFuncPtr, ...] | None:  # type: ignore[name-defined]
    lib = load_library("gguf_blocks")
    if lib is None:
        return None
    row_bytes = lib.gguf_row_bytes
    row_bytes.argtypes, row_bytes.restype = [ctypes.c_int, I64], I64
    dequantize = load_function("gguf_blocks", "gguf_dequantize", [ctypes.c_int, PTR, I64, I64, PTR])
    to_int8 = load_function("gguf_blocks", "gguf_quantize_int8", [ctypes.c_int, PTR, I64, I64, PTR, PTR])
    gather = load_function("gguf_blocks", "gguf_gather_rows", [ctypes.c_int, PTR, I64, PTR, I64, PTR])
    assert dequantize is not None and to_int8 is not None and gather is not None
    return row_bytes, dequantize, to_int8, gather


def gguf_decoding_available() -> bool:
    return _gguf_fns() is not None


def gguf_decodable(tensor_type: int, cols: int) -> bool:
    """Whether gguf_blocks.c decodes rows of `cols` values of this GGML type (F32/F16/BF16, Q4_0-Q8_0 and
    the k-quants Q2_K-Q6_K)."""
    fns = _gguf_fns()
    return fns is not None and fns[0](tensor_type, cols) > 0


def _gguf_source(data: np.ndarray, tensor_type: int, rows: int, cols: int) -> int:
    fns = _gguf_fns()
    assert fns is not None
    if data.nbytes != rows * fns[0](tensor_type, cols) or not data.flags.c_contiguous:
        raise ValueError(f"GGUF tensor data of {data.nbytes} bytes is not {rows} rows of {cols} values")
    return int(data.ctypes.data)


def gguf_dequantize(data: np.ndarray, tensor_type: int, rows: int, cols: int) -> torch.Tensor:
    """The float32 [rows, cols] of a GGUF tensor's bytes (a view into the file's map), bit-identical to the
    `gguf` package's numpy dequantization."""
    out = torch.empty(rows, cols, dtype=torch.float32)
    fns = _gguf_fns()
    assert fns is not None
    fns[1](tensor_type, _gguf_source(data, tensor_type, rows, cols), rows, cols, out.data_ptr())
    return out


def gguf_to_int8_rows(data: np.ndarray, tensor_type: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [rows, cols], scale [rows]) of a GGUF tensor's bytes, as int8_linear.quantize_rows of its float32
    dequantization, without making that float32 copy."""
    q = torch.empty(rows, cols, dtype=torch.int8)
    scale = torch.empty(rows, dtype=torch.float32)
    fns = _gguf_fns()
    assert fns is not None
    fns[2](tensor_type, _gguf_source(data, tensor_type, rows, cols), rows, cols, q.data_ptr(), scale.data_ptr())
    return q, scale


def gguf_gather_rows(data: np.ndarray, tensor_type: int, rows: int, cols: int, index: torch.Tensor) -> torch.Tensor:
    """float32 [len(index), cols]: the rows `index` of a GGUF tensor, decoded from its bytes."""
    fns = _gguf_fns()
    assert fns is not None
    index = index.to(torch.int64).contiguous()
    if index.numel() and not 0 <= int(index.min()) <= int(index.max()) < rows:
        raise IndexError(f"row index out of range [0, {rows})")
    out = torch.empty(index.numel(), cols, dtype=torch.float32)
    fns[3](tensor_type, _gguf_source(data, tensor_type, rows, cols), cols, index.data_ptr(), index.numel(),
           out.data_ptr())
    return out


@functools.cache
def _gguf_matmul_fns() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | None:  # type: ignore[name-defined]
    lib = load_library("gguf_matmul")
    if lib is None or not lib.gguf_matmul_available() or not int8_grouped_available():
        return None
    supports = lib.gguf_matmul_supports
    supports.argtypes, supports.restype = [ctypes.c_int], ctypes.c_int
    matmul = load_function("gguf_matmul", "gguf_matmul", [I64, PTR, PTR, PTR, PTR, I64, PTR, PTR, PTR, I64,
                                                      PTR, PTR, I64])
    assert matmul is not None
    return supports, matmul


def gguf_matmul_supported(tensor_type: int, cols: int) -> bool:
    """Whether gguf_matmul.c executes rows of `cols` values of this GGML type as stored (AVX2 hosts)."""
    fns = _gguf_matmul_fns()
    return fns is not None and bool(fns[0](tensor_type)) and gguf_decodable(tensor_type, cols)


@functools.cache
def _gguf_panel_fns() -> tuple[ctypes._CFuncPtr, ...] | None:  # type: ignore[name-defined]
    lib = load_library("gguf_panels")
    if lib is None or not lib.gguf_panels_available() or not int8_grouped_available():
        return None
    supports, panel_bytes = lib.gguf_panels_supports, lib.gguf_panel_bytes
    supports.argtypes, supports.restype = [ctypes.c_int], ctypes.c_int
    panel_bytes.argtypes, panel_bytes.restype = [ctypes.c_int, I64], I64
    pack = load_function("gguf_panels", "gguf_panels_pack", [ctypes.c_int, PTR, I64, I64, PTR, PTR])
    matmul = load_function("gguf_panels", "gguf_panels_matmul", [I64, PTR, PTR, PTR, I64, PTR, PTR, PTR, I64,
                                                             PTR, PTR, I64])
    assert pack is not None and matmul is not None
    return supports, panel_bytes, pack, matmul


def gguf_panels_available() -> bool:
    """Whether GGUF weights are repacked into 16-row panels here (kernels/gguf_panels.c: AVX512-VNNI or AVX2)."""
    return _gguf_panel_fns() is not None


def _panel_bytes(tensor_type: int, cols: int) -> int:
    fns = _gguf_panel_fns()
    return 0 if fns is None or not fns[0](tensor_type) else int(fns[1](tensor_type, cols))


class GGUFMatmulPlan:
    """The stacked GGUF tensors of one linear layer, as the kernels read them (built once, at load): on
    AVX512-VNNI and AVX2 hosts repacked into 16-row panels (gguf_panels.c; the file's bytes are then no longer
    read), else the file's blocks in place (gguf_matmul.c). A step then costs one quantize_groups call and one
    kernel call."""

    def __init__(self, parts: list[tuple[np.ndarray, int, int, torch.Tensor | None]], cols: int,
                 panels: bool | None = None) -> None:
        """parts: (bytes [rows, row bytes], GGML type, rows, row_index (int64) or None), stacked in order;
        panels: repack (None: wherever this host has the panel kernel and every part's type has one)."""
        count = len(parts)
        for data, tensor_type, rows, order in parts:
            _gguf_source(data, tensor_type, rows, cols)  # checks the bytes
            if order is not None:
                assert order.dtype == torch.int64 and order.is_contiguous() and order.numel() == rows
        packable = all(_panel_bytes(t, cols) > 0 for _, t, _, _ in parts)
        if panels and not packable:
            raise ValueError("these GGUF tensors cannot be repacked into panels on this host")
        self.panels = packable if panels is None else panels
        self.cols, self.outputs = cols, sum(rows for _, _, rows, _ in parts)
        self.packed: list[np.ndarray] = []  # the panels (repacked plans)
        self._keep: list[tuple[np.ndarray, torch.Tensor | None]] = []  # the file's arrays (in-place plans)
        if self.panels:
            fns = _gguf_panel_fns()
            assert fns is not None
            for data, tensor_type, rows, order in parts:
                packed = np.empty(-(-rows // 16) * _panel_bytes(tensor_type, cols), dtype=np.uint8)
                fns[2](tensor_type, data.ctypes.data, rows, cols, None if order is None else order.data_ptr(),
                       packed.ctypes.data)
                self.packed.append(packed)
            addresses = [int(a.ctypes.data) for a in self.packed]
            row_index = [0] * count
        else:
            self._keep = [(data, order) for data, _, _, order in parts]
            addresses = [int(d.ctypes.data) for d, _, _, _ in parts]
            row_index = [0 if o is None else o.data_ptr() for _, _, _, o in parts]
        self.types = (ctypes.c_int * count)(*(t for _, t, _, _ in parts))
        self.weights = (ctypes.c_void_p * count)(*addresses)
        self.rows = (ctypes.c_int64 * count)(*(r for _, _, r, _ in parts))
        self.row_index = (ctypes.c_void_p * count)(*row_index)
        self.count = count

    @property
    def nbytes(self) -> int:
        """Bytes of the panels this plan holds (0 where it reads the file's blocks in place)."""
        return sum(a.nbytes for a in self.packed)


def gguf_matmul(x: torch.Tensor, plan: GGUFMatmulPlan, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [tokens, k] float32 @ W.T, W the plan's stacked GGUF tensors executed as stored: activations quantized
    per group of 32 (quantize_groups), integer dots per block (kernels/gguf_panels.c or gguf_matmul.c)."""
    assert x.shape[1] == plan.cols and x.is_contiguous()
    q, scales, corr = quantize_groups(x)
    out = torch.empty(x.shape[0], plan.outputs, dtype=torch.float32)
    args = (q.data_ptr(), scales.data_ptr(), corr.data_ptr(), x.shape[0], 0 if bias is None else bias.data_ptr(),
            out.data_ptr(), out.stride(0))
    if plan.panels:
        panel_fns = _gguf_panel_fns()
        assert panel_fns is not None
        panel_fns[3](plan.count, plan.types, plan.weights, plan.rows, plan.cols, *args)
    else:
        fns = _gguf_matmul_fns()
        assert fns is not None
        fns[1](plan.count, plan.types, plan.weights, plan.rows, plan.row_index, plan.cols, *args)
    return out
