"""Multi-LoRA's native batched add (kernels/lora.c): each row's adapter, shrink and expand, added in place."""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenmill.kernels.build import I64, PTR, load_function


class LoRAWeightsPointers(ctypes.Structure):
    """One projection's LoRA parts in the resident slots (kernels/lora.c: LoRAWeights), as raw addresses."""

    _fields_ = [("parts", I64), ("in_features", I64), ("max_rank", I64), ("offset", PTR), ("width", PTR),
                ("at", PTR), ("bt", PTR), ("ranks", PTR), ("slots", I64), ("bf16", I64)]


class LoRABatchPointers(ctypes.Structure):
    """A step's rows grouped by adapter slot (kernels/lora.c: LoRABatch)."""

    _fields_ = [("segments", I64), ("slot", PTR), ("start", PTR), ("rows", PTR)]


@functools.cache
def _lora_fn() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return load_function("lora", "lora_add", [PTR, PTR, PTR, I64, PTR, I64])


def lora_add_supported(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and _lora_fn() is not None


def lora_add(weights: LoRAWeightsPointers, batch: LoRABatchPointers, x: torch.Tensor, y: torch.Tensor) -> None:
    """In place: y[row, part columns] += (x[row] @ At[slot]) @ Bt[slot] for the batch's rows (kernels/lora.c).
    x [T, in], y [T, out] float32 with unit column stride."""
    fn = _lora_fn()
    assert fn is not None and x.stride(1) == 1 and y.stride(1) == 1 and x.dtype == y.dtype == torch.float32
    fn(ctypes.addressof(weights), ctypes.addressof(batch), x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0))
