"""The fused layer kernels (kernels/layer_ops.c): residual add + RMSNorm, per-head RMSNorm, rotary positions
with the KV cache write (quantized as it writes for 8-bit caches), and the gated activations."""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

from tokenmill.kernels.build import F32, I64, PTR, load_function
from tokenmill.kernels.kv_attention import MAX_HEAD_DIM, cache_pointers, key_channel_pointer
from tokenmill.model.kv_quant import LayerKV


class _LayerFns(NamedTuple):
    add_rms_norm: ctypes._CFuncPtr  # type: ignore[name-defined]
    rope_and_cache: ctypes._CFuncPtr  # type: ignore[name-defined]
    silu_and_mul: ctypes._CFuncPtr  # type: ignore[name-defined]
    gelu_tanh_and_mul: ctypes._CFuncPtr  # type: ignore[name-defined]
    rms_norm_heads: ctypes._CFuncPtr  # type: ignore[name-defined]


@functools.cache
def _layer_fns() -> _LayerFns | None:
    fns = (
        load_function("layer_ops", "add_rms_norm", [PTR, PTR, I64, PTR, F32, PTR, I64, I64]),
        load_function("layer_ops", "rope_and_cache", [PTR, I64, I64, I64, I64, I64, PTR, PTR, PTR, I64,
                                                  PTR, PTR, PTR, PTR, PTR, PTR, I64]),
        load_function("layer_ops", "silu_and_mul", [PTR, I64, I64, PTR]),
        load_function("layer_ops", "gelu_tanh_and_mul", [PTR, I64, I64, PTR]),
        load_function("layer_ops", "rms_norm_heads", [PTR, I64, I64, I64, I64, PTR, F32]),
    )
    return None if any(fn is None for fn in fns) else _LayerFns(*fns)


def layer_ops_available() -> bool:
    return _layer_fns() is not None


def layer_ops_supported(x: torch.Tensor) -> bool:
    """Whether the fused layer kernels take x (float32 on CPU) on this machine."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and _layer_fns() is not None


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += delta (in place, when given); returns RMSNorm(residual) * weight. [rows, cols] float32."""
    fns = _layer_fns()
    assert fns is not None and residual.is_contiguous() and weight.is_contiguous()
    rows, cols = residual.shape
    if delta is not None:
        assert delta.shape == residual.shape and delta.stride(1) == 1
    out = torch.empty_like(residual)
    fns.add_rms_norm(residual.data_ptr(), None if delta is None else delta.data_ptr(),
                     0 if delta is None else delta.stride(0), weight.data_ptr(), eps, out.data_ptr(), rows, cols)
    return out


def rms_norm_heads(x: torch.Tensor, heads: int, weight: torch.Tensor, eps: float) -> None:
    """QK-norm in place: the first `heads` heads of every row of x [T, >= heads * head_dim] (the q or k part of
    the fused projection, a view with unit column stride) each through RMSNorm * weight [head_dim]."""
    fns = _layer_fns()
    head_dim = weight.shape[0]
    assert fns is not None and x.dtype == torch.float32 and x.stride(1) == 1 and weight.is_contiguous()
    assert x.shape[1] >= heads * head_dim
    fns.rms_norm_heads(x.data_ptr(), x.stride(0), x.shape[0], heads, head_dim, weight.data_ptr(), eps)


def rope_and_cache(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                   slot_mapping: torch.Tensor, cache: LayerKV) -> torch.Tensor:
    """RoPE on q and k of the fused projection [T, (heads + 2 kv_heads) * head_dim]; k and v go to their cache
    slots (quantized as they are written in an 8-bit format, keys divided by the cache's channel scales); returns
    q [T, heads, head_dim] (times those scales). cos, sin: [T, head_dim] rows of this step's positions."""
    fns = _layer_fns()
    tokens, head_dim = qkv.shape[0], cos.shape[-1]
    assert fns is not None and qkv.stride(1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    assert slot_mapping.dtype == torch.int64 and head_dim <= MAX_HEAD_DIM
    q = torch.empty(tokens, num_heads, head_dim)
    *pointers, kind = cache_pointers(cache)
    fns.rope_and_cache(qkv.data_ptr(), qkv.stride(0), tokens, num_heads, num_kv_heads, head_dim, cos.data_ptr(),
                       sin.data_ptr(), slot_mapping.data_ptr(), cache.k.shape[3], *pointers,
                       key_channel_pointer(cache), q.data_ptr(), kind)
    return q


def gated_activation(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """act(gate) * up for gate_up [rows, 2n] (gate first, contiguous) -> [rows, n]: SiLU (SwiGLU) or, with
    `gelu`, GELU's tanh approximation (GeGLU)."""
    fns = _layer_fns()
    assert fns is not None and gate_up.is_contiguous()
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n)
    (fns.gelu_tanh_and_mul if gelu else fns.silu_and_mul)(gate_up.data_ptr(), rows, n, out.data_ptr())
    return out
