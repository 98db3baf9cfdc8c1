"""The one-call decoder stack (kernels/decoder.c): every layer of a decode step in one native call, over
raw pointers to each layer's weights (int8 packed or GGUF panels) and KV cache."""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenmill.kernels.build import F32, I64, PTR, load_function, load_library
from tokenmill.kernels.gguf_ops import GGUFMatmulPlan
from tokenmill.kernels.kv_attention import cache_pointers, key_channel_pointer
from tokenmill.kernels.lora_ops import LoRABatchPointers
from tokenmill.model.kv_quant import LayerKV


class LinearPointers(ctypes.Structure):
    """One projection for `decoder_forward` (kernels/decoder.c: Linear): int8 weights packed for the grouped
    kernel and their scales, or (packed NULL) a GGUFMatmulPlan's arrays."""

    _fields_ = [("packed", PTR), ("scale", PTR), ("parts", I64), ("types", PTR), ("weights", PTR),
                ("rows", PTR), ("row_index", PTR), ("panels", I64), ("lora", PTR)]

    def set_int8(self, packed: torch.Tensor, scale: torch.Tensor) -> None:
        self.packed, self.scale = packed.data_ptr(), scale.data_ptr()

    def set_gguf(self, plan: GGUFMatmulPlan) -> None:
        self.parts, self.panels = plan.count, int(plan.panels)
        self.types, self.weights, self.rows, self.row_index = (
            ctypes.addressof(a) for a in (plan.types, plan.weights, plan.rows, plan.row_index))


class DecoderLayerPointers(ctypes.Structure):
    """One layer's tensors for `decoder_forward` (kernels/decoder.c: DecoderLayer), as raw addresses."""

    _fields_ = [("input_norm", PTR), ("post_norm", PTR), *((name, LinearPointers) for name in
                ("qkv", "o", "gate_up", "down")), ("qkv_bias", PTR), ("k_cache", PTR), ("v_cache", PTR),
                ("k_scale", PTR), ("v_scale", PTR), ("k_channel", PTR), ("q_norm", PTR), ("k_norm", PTR),
                ("attn_out_norm", PTR), ("mlp_out_norm", PTR), ("window", I64), ("local_rope", I64)]

    def set_cache(self, cache: LayerKV) -> None:
        self.k_cache, self.v_cache, self.k_scale, self.v_scale, _ = cache_pointers(cache)
        self.k_channel = key_channel_pointer(cache)


@functools.cache
def _decoder_fn() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    lib = load_library("decoder")
    if lib is None or not lib.int8_grouped_available():
        return None
    return load_function("decoder", "decoder_forward", [PTR, I64, I64, I64, I64, I64, I64, I64, F32, PTR, PTR,
                                                    PTR, PTR, PTR, PTR, PTR, PTR, I64, PTR, PTR, PTR,
                                                    I64, I64, F32, I64, I64, PTR])


def decoder_stack_available() -> bool:
    """Whether the one-call decoder stack (kernels/decoder.c: int8 or GGUF-block projections) runs on this CPU
    (AVX512-VNNI or AVX2)."""
    return _decoder_fn() is not None


def decoder_work_floats(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> int:
    """Scratch floats per token that `decoder_forward` needs."""
    return 2 * hidden + (heads + 2 * kv_heads) * head_dim + 2 * heads * head_dim + 3 * intermediate


def decoder_forward(layers: ctypes.Array, dims: tuple[int, int, int, int, int], eps: float, residual: torch.Tensor,
                    work: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                    local_rope: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor, block_size: int,
                    query_start: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                    kv_kind: int, gelu: bool, lora: LoRABatchPointers | None = None) -> torch.Tensor:
    """Every decoder layer over a flat batch in one call. dims = (hidden, heads, kv_heads, head_dim,
    intermediate); residual [T, hidden] float32: the embeddings in, the residual stream out (in place); work: at
    least T * decoder_work_floats(...) floats; rope and local_rope: (cos, sin) rows [T, head_dim] of the layers
    without and with `local_rope`; kv_kind: the caches' format (kv_formats.h); gelu: GeGLU MLPs. Returns the
    last layer's MLP output [T, hidden]."""
    fn = _decoder_fn()
    hidden, heads, kv_heads, head_dim, intermediate = dims
    tokens = residual.shape[0]
    assert fn is not None and residual.is_contiguous() and residual.dtype == torch.float32
    assert work.numel() >= tokens * decoder_work_floats(*dims)
    assert all(table.is_contiguous() and table.shape == (tokens, head_dim) for table in (*rope, *local_rope))
    for index in (slot_mapping, query_start, seq_lens, block_tables):
        assert index.dtype == torch.int64 and index.is_contiguous()
    x_out = torch.empty(tokens, hidden)
    fn(ctypes.addressof(layers), len(layers), tokens, hidden, heads, kv_heads, head_dim, intermediate, eps,
       residual.data_ptr(), x_out.data_ptr(), work.data_ptr(), rope[0].data_ptr(), rope[1].data_ptr(),
       local_rope[0].data_ptr(), local_rope[1].data_ptr(), slot_mapping.data_ptr(), block_size,
       query_start.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(), seq_lens.shape[0], block_tables.shape[1],
       scale, kv_kind, int(gelu), None if lora is None else ctypes.addressof(lora))
    return x_out
