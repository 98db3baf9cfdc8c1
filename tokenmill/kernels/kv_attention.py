"""The native paged attention (kernels/paged_attention.c) over a layer's KV cache in any format of
model/kv_quant.py, and the cache's raw pointers the kernels take."""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenmill.kernels.build import F32, I64, PTR, load_function, load_library
from tokenmill.model.kv_quant import LayerKV

# Limits compiled into paged_attention.c (stack arrays).
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 64, 256, 64


@functools.cache
def _attention_fn() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return load_function("paged_attention", "paged_attention", [PTR] * 9 + [I64] * 8 + [F32, I64, I64])


def cache_pointers(cache: LayerKV) -> tuple[int, int, int | None, int | None, int]:
    """(K, V, K scales or None, V scales or None, format code) of a layer's cache, for the kernels (kv_formats.h)."""
    assert cache.k.is_contiguous() and cache.v.is_contiguous() and cache.k.dtype == cache.v.dtype
    kind = cache.format.kind
    assert kind >= 0, f"the native kernels do not read a {cache.k.dtype} cache"
    if cache.k_scale is None or cache.v_scale is None:
        return cache.k.data_ptr(), cache.v.data_ptr(), None, None, kind
    assert cache.k_scale.is_contiguous() and cache.v_scale.is_contiguous()
    return cache.k.data_ptr(), cache.v.data_ptr(), cache.k_scale.data_ptr(), cache.v_scale.data_ptr(), kind


def key_channel_pointer(cache: LayerKV) -> int | None:
    """The keys' channel scales of an int8 cache [kv_heads, head_dim] float32 (kernels/layer_ops.c), or None."""
    scales = cache.key_channel_scale
    if scales is None:
        return None
    assert scales.dtype == torch.float32 and scales.is_contiguous()
    return scales.data_ptr()


def native_attention_available() -> bool:
    return _attention_fn() is not None


@functools.cache
def attention_bf16_available() -> bool:
    """Whether the attention kernel reads bf16 caches on this CPU at all (its AVX-512 path)."""
    lib = load_library("paged_attention")
    return lib is not None and bool(lib.paged_attention_bf16_available())


def _block_path(cache: LayerKV, flag: str, dtypes: tuple[torch.dtype, ...]) -> bool:
    """Whether the kernel's AVX-512 block path (blocks of 16, head_dim a multiple of 64) takes this cache, in one of
    `dtypes`, with the arithmetic the library's `flag` function says this build has."""
    lib = load_library("paged_attention")
    k = cache.k
    return (lib is not None and bool(getattr(lib, flag)()) and k.dtype in dtypes and k.shape[3] == 16
            and k.shape[2] % 64 == 0)


def bf16_dot_attention(cache: LayerKV) -> bool:
    """Whether the native attention takes this bf16 cache's scores and sum over V in bf16 dot products
    (AVX512-BF16): each query row and each block's softmax weights rounded to bf16 (to nearest even, as GPU
    attention kernels round them), the products summed in float32 (twice the float multiply-add's rate). Per row:
    batch invariance holds. The denominator sums the unrounded weights."""
    return _block_path(cache, "paged_attention_bf16_dots", (torch.bfloat16,))


def bf16_softmax_weights(cache: LayerKV) -> bool:
    """Whether the native attention's sum over V takes each block's softmax weights (times the values' scales)
    rounded to bf16, in bf16 dot products (AVX512-BF16): every format the kernel reads but float32 (whose path
    stays float32 throughout)."""
    return _block_path(cache, "paged_attention_bf16_dots",
                       (torch.bfloat16, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2))


def integer_attention(cache: LayerKV) -> bool:
    """Whether the native attention computes this int8 cache's scores in integer arithmetic (AVX512-VNNI with
    VBMI): each query row quantized to int8 (scale amax / 127) for exact int32 scores; the sum over V as
    bf16_softmax_weights says. Per row: batch invariance holds."""
    return _block_path(cache, "paged_attention_int8_scores", (torch.int8,))


def bf16_cache_supported(head_dim: int, block_size: int) -> bool:
    """Whether the native attention reads a bf16 cache of these shapes (its AVX-512 path: blocks of 16,
    head_dim a multiple of 64)."""
    return block_size == 16 and head_dim % 64 == 0 and attention_bf16_available()


def attention_supported(query: torch.Tensor, num_heads: int, cache: LayerKV) -> bool:
    """Whether the native kernel takes a float32 CPU `query` of `num_heads` heads over this layer's cache (shapes
    within its compiled limits; float32 and 8-bit caches everywhere, bf16 only on its AVX-512 path), with or
    without a sliding window."""
    k_cache = cache.k
    num_kv_heads, head_dim, block_size = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    bf16 = k_cache.dtype == torch.bfloat16
    cache_ok = bf16_cache_supported(head_dim, block_size) if bf16 else cache.format.kind >= 0
    return (
        query.device.type == "cpu" and query.dtype == torch.float32 and cache_ok
        and num_heads // num_kv_heads <= MAX_GROUP and head_dim <= MAX_HEAD_DIM and block_size <= MAX_BLOCK
        and _attention_fn() is not None
    )


def paged_attention(out: torch.Tensor, query: torch.Tensor, cache: LayerKV, query_start: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                    window: int | None = None) -> None:
    """Causal attention of every query row over its sequence's cached keys (this step's K/V already written).

    Sequence s owns query rows query_start[s]..query_start[s+1] (its last q_len tokens) and has seq_lens[s]
    tokens of context after this step. out, query: [T, heads, head_dim] whose rows are contiguous (row strides
    may differ); caches contiguous in `model.attention.allocate_kv_cache`'s layout; query_start [S+1], seq_lens [S],
    block_tables [S, max_blocks] int64 contiguous. `window` (sliding-window layers): a row at position p sees
    keys p - window + 1 .. p.
    """
    fn = _attention_fn()
    assert fn is not None, "check attention_supported() first"
    for index in (query_start, seq_lens, block_tables):
        assert index.dtype == torch.int64 and index.is_contiguous()
    assert query.stride(2) == out.stride(2) == 1 and query.stride(1) == out.stride(1) == query.shape[2]
    heads, head_dim = query.shape[1], query.shape[2]
    if window is not None and window < 1:
        raise ValueError("windowed native attention needs window >= 1")
    *pointers, kind = cache_pointers(cache)
    fn(out.data_ptr(), query.data_ptr(), *pointers, query_start.data_ptr(), seq_lens.data_ptr(),
       block_tables.data_ptr(), seq_lens.shape[0], block_tables.shape[1], heads, cache.k.shape[1], head_dim,
       cache.k.shape[3], query.stride(0), out.stride(0), scale, kind, window or 0)
