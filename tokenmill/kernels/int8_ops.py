"""The int8 linear kernels (kernels/int8_rows.c): two-level row quantization and its dequantization around
torch's int8 GEMM, and the grouped-activation int8 GEMM over weights packed at load (AVX512-VNNI or AVX2)."""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenmill.kernels.build import I64, PTR, load_function, load_library


@functools.cache
def _quantize_fn() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return load_function("int8_rows", "quantize_two_level", [PTR, I64, I64, I64, PTR, PTR])


@functools.cache
def _dequantize_fn() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return load_function("int8_rows", "dequantize_two_level", [PTR, I64, I64, PTR, PTR, PTR, PTR])


@functools.cache
def _grouped_fns() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | None:  # type: ignore[name-defined]
    lib = load_library("int8_rows")
    if lib is None or not lib.int8_grouped_available():
        return None
    quantize = load_function("int8_rows", "quantize_groups", [PTR, I64, I64, I64, PTR, PTR, PTR])
    linear = load_function("int8_rows", "int8_linear_grouped", [PTR, I64, I64, I64, PTR, PTR, PTR, PTR, I64])
    assert quantize is not None and linear is not None
    return quantize, linear


@functools.cache
def _pack_fns() -> tuple[int, ctypes._CFuncPtr]:  # type: ignore[name-defined]
    """(outputs per packed vector of this CPU's grouped kernel: 16 for AVX512-VNNI, 8 for AVX2; int8_pack)."""
    lib = load_library("int8_rows")
    pack = load_function("int8_rows", "int8_pack", [PTR, I64, I64, PTR])
    assert lib is not None and pack is not None
    return int(lib.int8_pack_lanes()), pack


INT8_GROUP = 32  # activations share one int8 scale per row and 32 consecutive input features (int8_rows.c)


def int8_grouped_available() -> bool:
    """Whether this CPU runs the grouped-activation int8 kernel (AVX512-VNNI, or AVX2 with FMA)."""
    return _grouped_fns() is not None


def pack_vnni(weight: torch.Tensor) -> torch.Tensor:
    """int8 weight [n, k] (k a multiple of 4) -> packed [ceil(n/L), k/4, L, 4], the layout `int8_linear_grouped`
    reads (int8_rows.c): L outputs per vector, four consecutive k each; on VNNI hosts (L = 16) the bytes hold
    w + 128 as unsigned."""
    lanes, pack = _pack_fns()
    n, k = weight.shape
    if k % 4:
        raise ValueError(f"packing needs in_features a multiple of 4, got {k}")
    weight = weight.contiguous()
    out = torch.empty(-(-n // lanes), k // 4, lanes, 4, dtype=torch.int8)
    pack(weight.data_ptr(), n, k, out.data_ptr())
    return out


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, k] float32 (k a multiple of 32, rows contiguous) -> (q [rows, k] int8, scales [rows, k/32],
    corr [rows, k/32] int32 = 128 * each group's sum of q)."""
    fns = _grouped_fns()
    assert fns is not None and x.dtype == torch.float32 and x.stride(1) == 1 and x.shape[1] % INT8_GROUP == 0
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.int8)
    scales = torch.empty(rows, k // INT8_GROUP)
    corr = torch.empty(rows, k // INT8_GROUP, dtype=torch.int32)
    fns[0](x.data_ptr(), rows, k, x.stride(0), q.data_ptr(), scales.data_ptr(), corr.data_ptr())
    return q, scales, corr


def int8_linear_grouped(x: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                        n: int) -> torch.Tensor:
    """The int8 linear for x [rows, k] float32 (rows contiguous, k a multiple of 32) in one native call:
    activations quantized per group of 32, exact int32 group sums, float accumulation over the groups."""
    fns = _grouped_fns()
    assert fns is not None and x.dtype == torch.float32 and x.stride(1) == 1 and packed.shape[1] * 4 == x.shape[1]
    assert x.shape[1] % INT8_GROUP == 0
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    fns[1](x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), packed.data_ptr(), weight_scale.data_ptr(),
           None if bias is None else bias.data_ptr(), out.data_ptr(), n)
    return out


def int8_rows_available() -> bool:
    return _quantize_fn() is not None and _dequantize_fn() is not None


def quantize_two_level(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] float32 (rows contiguous) -> (q [2 * rows, cols] int8, scales [2 * rows] float32)."""
    fn = _quantize_fn()
    assert fn is not None and x.dtype == torch.float32 and x.stride(1) == 1
    rows, cols = x.shape
    q = torch.empty(2 * rows, cols, dtype=torch.int8)
    scales = torch.empty(2 * rows, dtype=torch.float32)
    fn(x.data_ptr(), rows, cols, x.stride(0), q.data_ptr(), scales.data_ptr())
    return q, scales


def dequantize_two_level(acc: torch.Tensor, scales: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """acc [2 * rows, n] int32 of both levels -> float32 [rows, n] (see int8_rows.c)."""
    fn = _dequantize_fn()
    assert fn is not None and acc.is_contiguous() and acc.dtype == torch.int32
    rows, n = acc.shape[0] // 2, acc.shape[1]
    out = torch.empty(rows, n, dtype=torch.float32)
    fn(acc.data_ptr(), rows, n, scales.data_ptr(), weight_scale.data_ptr(),
       None if bias is None else bias.data_ptr(), out.data_ptr())
    return out
