"""Paged attention over a flat batch: a clear torch reference that runs on CPU and CUDA.

The KV cache of one layer (`kv_quant.LayerKV`) is two tensors of `num_blocks` blocks (layout in
`allocate_kv_cache`), in float or, with their per-token scales, in an 8-bit format (model/kv_quant.py). A sequence's
logical token i lives in physical block `block_table[i // block_size]` at offset `i % block_size`; blocks of a
sequence need not be contiguous or ordered. Each step first writes the new tokens' K/V at their slots
(`slot_mapping`), then every sequence attends over its own blocks: causally within the newly scheduled tokens
and fully over its cached context.

On CPU one native kernel (`tokenmill/kernels/paged_attention.c`) attends the whole flat batch, reading K/V in
place from the blocks, with the same float operations for a token whatever its batch or chunking. Elsewhere
(GPU, or no C compiler) the torch reference runs: sequences with one query token (decodes) in one batched SDPA
over their gathered blocks, sequences with several (prompt chunks) one flash-SDPA call each, since padding a
512-token chunk against 63 decodes would waste 64x the work.
"""

from __future__ import annotations

import functools
import math
import mmap
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill import kernels
from tokenmill.kernels import triton_ops
from tokenmill.model import kv_quant
from tokenmill.model.kv_quant import SCALE_DTYPE, KVFormat, LayerKV


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A step's metadata on the model's device: on a GPU through pinned host memory, copied without blocking the
    host (the copy is ordered before the kernels that read it on the same stream)."""
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


@dataclass
class PrefillSlice:
    """A sequence with more than one query token in this step."""

    start: int  # first row of its tokens in the flat batch
    end: int
    seq_len: int  # context length after this step (cached + new tokens)
    block_table: torch.Tensor  # [num_blocks_of_seq] physical block ids
    mask: torch.Tensor | None  # [q_len, seq_len] bool; None when there is no cached context (plain causal)


@dataclass
class ReferenceSplit:
    """The torch reference path's view of a batch: decodes attended in one batched call, prompt chunks one by
    one."""

    decode_rows: torch.Tensor  # [Bd] flat rows of single-token sequences
    decode_block_tables: torch.Tensor  # [Bd, max_blocks]
    decode_seq_lens: torch.Tensor  # [Bd] context length including this step's token
    prefills: list[PrefillSlice]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset) of every new token
    query_start: torch.Tensor  # [B+1] sequence i owns flat rows query_start[i] .. query_start[i+1]
    seq_lens: torch.Tensor  # [B] context length after this step
    block_tables: torch.Tensor  # [B, max_blocks] padded physical block ids
    block_size: int
    query_lens_np: np.ndarray  # the numpy inputs, kept for the reference split
    seq_lens_np: np.ndarray
    block_tables_np: np.ndarray

    @staticmethod
    def build(
        query_lens: np.ndarray,  # [B] tokens scheduled per sequence
        seq_lens: np.ndarray,  # [B] context length after this step
        block_tables: np.ndarray,  # [B, max_blocks] padded physical block ids
        slot_mapping: np.ndarray,  # [T]
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        block_tables = np.ascontiguousarray(block_tables)
        return AttentionMetadata(
            slot_mapping=to_device(slot_mapping, device),
            query_start=to_device(np.concatenate([[0], np.cumsum(query_lens)]), device),
            seq_lens=to_device(seq_lens, device),
            block_tables=to_device(block_tables, device),
            block_size=block_size,
            query_lens_np=query_lens,
            seq_lens_np=seq_lens,
            block_tables_np=block_tables,
        )

    @functools.cached_property
    def reference(self) -> ReferenceSplit:
        """Built on first use only: the native kernel, which serves CPU steps, needs none of it."""
        device, block_size = self.slot_mapping.device, self.block_size
        query_lens, seq_lens, tables = self.query_lens_np, self.seq_lens_np, self.block_tables_np
        starts = np.cumsum(query_lens) - query_lens
        is_decode = query_lens == 1
        decode_lens = seq_lens[is_decode]
        max_blocks = int(-(-decode_lens.max() // block_size)) if len(decode_lens) else 0
        prefills: list[PrefillSlice] = []
        for i in np.flatnonzero(~is_decode).tolist():
            q_len, seq_len, start = int(query_lens[i]), int(seq_lens[i]), int(starts[i])
            mask = None
            if seq_len != q_len:
                # query j sits at absolute position seq_len - q_len + j and sees keys up to it.
                q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
                mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
            table = torch.from_numpy(tables[i, :-(-seq_len // block_size)]).to(device)
            prefills.append(PrefillSlice(start, start + q_len, seq_len, table, mask))
        return ReferenceSplit(
            decode_rows=torch.from_numpy(starts[is_decode]).to(device),
            decode_block_tables=torch.from_numpy(np.ascontiguousarray(tables[is_decode, :max_blocks])).to(device),
            decode_seq_lens=torch.from_numpy(decode_lens).to(device),
            prefills=prefills,
        )


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's (K, V) value tensors. K keeps each block's keys transposed, [blocks, kv_heads, head_dim, block],
    so a block's scores are one vector over its tokens; V is [blocks, kv_heads, block, head_dim]."""
    return (_zeros((num_blocks, num_kv_heads, head_dim, block_size), dtype, device),
            _zeros((num_blocks, num_kv_heads, block_size, head_dim), dtype, device))


def allocate_layer_kv(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, fmt: KVFormat,
                      device: torch.device) -> LayerKV:
    """One layer's cache in `fmt`: its values, and in an 8-bit format a scale per token and KV head
    [blocks, kv_heads, block], and in int8 the keys' channel scales (ones until the model binds its own)."""
    k, v = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, fmt.storage, device)
    if not fmt.scaled:
        return LayerKV(k, v)
    shape = (num_blocks, num_kv_heads, block_size)
    channels = torch.ones(num_kv_heads, head_dim, device=device) if fmt.storage == torch.int8 else None
    return LayerKV(k, v, _zeros(shape, SCALE_DTYPE, device), _zeros(shape, SCALE_DTYPE, device), channels)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _untouched_zeros(shape, dtype) if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)


def _untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros in an anonymous memory map: the kernel hands out zero pages as they are first written, so a KV pool
    costs neither start-up time (torch.zeros writes every byte) nor resident memory before tokens fill it."""
    count = math.prod(shape)
    buffer = mmap.mmap(-1, max(1, count * dtype.itemsize))
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)  # the tensor keeps the map alive


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim] (already written to the cache)
    v: torch.Tensor,
    cache: LayerKV,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """`window`: a query at position p sees keys p - window + 1 .. p (sliding-window layers)."""
    out = torch.empty_like(q)
    if kernels.attention_supported(q, q.shape[1], cache):
        kernels.paged_attention(out, q, cache, meta.query_start, meta.seq_lens, meta.block_tables, scale, window)
        return out
    if gpu_kernels_apply(q, cache):
        triton_ops.paged_attention(out, q.contiguous(), cache, meta.query_start, meta.seq_lens, meta.block_tables,
                                   scale, window)
        return out
    split = meta.reference
    if split.decode_rows.numel():
        out[split.decode_rows] = _decode_attention_torch(q[split.decode_rows], cache, split, scale, window)
    for p in split.prefills:
        # 4-D [1, heads, q, hd] inputs: torch's CPU flash kernel only takes batched 4-D tensors; 3-D ones fall
        # back to the math path, which is 6x slower on a 3,000-token prompt.
        query = q[p.start:p.end].transpose(0, 1).unsqueeze(0)
        mask = p.mask if window is None else _window_mask(p.end - p.start, p.seq_len, window, q.device)
        if mask is None and cache.format.scaled:  # attend to what later steps will read: the stored values
            mask = _window_mask(p.end - p.start, p.seq_len, p.seq_len, q.device)
        if mask is None:  # no cached context: the new tokens are the whole sequence
            keys = k[p.start:p.end].transpose(0, 1).unsqueeze(0)
            values = v[p.start:p.end].transpose(0, 1).unsqueeze(0)
            attn = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale,
                                                  enable_gqa=True)
        else:
            keys, values = kv_quant.gather(cache, p.block_table[None], q.dtype)
            attn = F.scaled_dot_product_attention(query, keys[:, :, :p.seq_len], values[:, :, :p.seq_len],
                                                  attn_mask=mask, scale=scale, enable_gqa=True)
        out[p.start:p.end] = attn[0].transpose(0, 1)
    return out


def gpu_kernels_apply(x: torch.Tensor, cache: LayerKV) -> bool:
    """The Triton kernels serve a layer whose activations are `x`: a CUDA device with triton, a cache of shapes
    they tile (head_dim is the K cache's dimension 2); fp8 caches from compute capability 8.9 on (Triton's fp8
    conversions), older GPUs take the torch path for them."""
    if not triton_ops.attention_kernel_serves(x.device, cache.k.shape[2], cache.k.shape[3]):
        return False
    fp8 = cache.k.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    return not fp8 or torch.cuda.get_device_capability(x.device) >= (8, 9)


def _window_mask(q_len: int, seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    """[q_len, seq_len] bool: causal and within the window, for the last q_len positions of seq_len."""
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    return (k_pos <= q_pos) & (k_pos > q_pos - window)


def _decode_attention_torch(query: torch.Tensor, cache: LayerKV, split: ReferenceSplit, scale: float,
                            window: int | None = None) -> torch.Tensor:
    """The reference decode path: gather every sequence's blocks (padded), one batched SDPA with a length mask."""
    keys, values = kv_quant.gather(cache, split.decode_block_tables, query.dtype)
    key_index = torch.arange(keys.shape[2], device=query.device)[None, :]
    lengths = split.decode_seq_lens[:, None]
    visible = key_index < lengths
    if window is not None:
        visible &= key_index >= lengths - window
    attn = F.scaled_dot_product_attention(query.unsqueeze(2), keys, values, attn_mask=visible[:, None, None, :],
                                          scale=scale, enable_gqa=True)
    return attn.squeeze(2)
