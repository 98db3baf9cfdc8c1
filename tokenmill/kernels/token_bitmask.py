"""Structured outputs' token bitmask applied to logits rows in place (kernels/token_bitmask.c)."""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenmill.kernels.build import I64, PTR, load_function


@functools.cache
def _bitmask_fn() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return load_function("token_bitmask", "apply_token_bitmask", [PTR, I64, PTR, I64, PTR, I64, I64])


def token_bitmask_available() -> bool:
    return _bitmask_fn() is not None


def token_bitmask_supported(logits: torch.Tensor) -> bool:
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and _bitmask_fn() is not None)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask row i is clear (token_bitmask.c)."""
    fn = _bitmask_fn()
    assert fn is not None
    rows = rows.to(torch.int64).contiguous()
    bitmask = bitmask.contiguous()
    fn(logits.data_ptr(), logits.stride(0), rows.data_ptr(), rows.numel(), bitmask.data_ptr(), bitmask.shape[1],
       logits.shape[1])
