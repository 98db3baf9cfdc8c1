"""Triton kernels for the GPU path, with the CPU kernels' interfaces (kernels/paged_attention.c, layer_ops.c,
token_bitmask.c): paged attention over a flat batch that mixes prompt chunks and decodes, the fused rope + KV
write, and the token bitmask.

They run on CUDA devices, and on CPU under Triton's interpreter (`TRITON_INTERPRET=1`, set before triton is
imported), which is how CI checks them against the torch reference. `triton` is an optional dependency
(installed with torch on CUDA machines): without it the torch paths run.

Paged attention: one program per (query row, KV head) computes the whole GQA group of that head (padded to 16
rows for `tl.dot`) over the row's visible key blocks with an online softmax, in float32; the K cache is
[blocks, kv_heads, head_dim, block] (keys transposed per block), V [blocks, kv_heads, block, head_dim].
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from tokenmill.model.kv_quant import LayerKV


@functools.cache
def triton_module() -> Any:
    """The `triton` package, or None where it is missing."""
    try:
        import triton
    except ImportError:
        return None
    return triton


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernels serve tensors on `device`: CUDA with triton installed, or any device under the
    interpreter (tests)."""
    if triton_module() is None or os.environ.get("TOKENMILL_DISABLE_TRITON"):
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def attention_shapes_supported(head_dim: int, block_size: int) -> bool:
    """tl.arange needs powers of two; tl.dot needs at least 16 along every dimension."""
    return _power_of_two(head_dim) and _power_of_two(block_size) and head_dim >= 16 and block_size >= 16


def attention_kernel_serves(device: torch.device, head_dim: int, block_size: int) -> bool:
    """The Triton attention (and rope + KV write) serves a CUDA layer of this head_dim over blocks of this
    size."""
    return device.type == "cuda" and triton_usable(device) and attention_shapes_supported(head_dim, block_size)


@functools.cache
def _kernels() -> dict[str, Any]:
    triton = triton_module()
    assert triton is not None
    import triton.language as tl

    @triton.jit
    def paged_attention_kernel(out_ptr, q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tables_ptr, row_seq_ptr, row_pos_ptr,
                               scale, window, q_stride, out_stride, max_blocks,
                               KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                               HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, SCALED: tl.constexpr):
        # SCALED: an 8-bit cache, K/V values times their bf16 scale per token (ks_ptr, vs_ptr: [blocks,
        # kv_heads, block]); the scores take the keys' scales, the weights the values' after their sum
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq = tl.load(row_seq_ptr + row)
        pos = tl.load(row_pos_ptr + row)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        t = tl.arange(0, BLOCK)
        heads = kv_head * GROUP + g
        in_group = g < GROUP
        q = tl.load(q_ptr + row * q_stride + heads[:, None] * HEAD_DIM + d[None, :], mask=in_group[:, None],
                    other=0.0).to(tl.float32)
        first = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for b in range(first // BLOCK, pos // BLOCK + 1):
            block = tl.load(tables_ptr + seq * max_blocks + b)
            base = block * KV_HEADS + kv_head
            k = tl.load(k_ptr + (base * HEAD_DIM + d[:, None]) * BLOCK + t[None, :]).to(tl.float32)
            scores = tl.dot(q, k, input_precision="ieee") * scale
            if SCALED:
                scores = scores * tl.load(ks_ptr + base * BLOCK + t).to(tl.float32)[None, :]
            key_pos = b * BLOCK + t
            visible = (key_pos <= pos) & (key_pos >= first)
            scores = tl.where(visible[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + (base * BLOCK + t[:, None]) * HEAD_DIM + d[None, :]).to(tl.float32)
            if SCALED:
                p = p * tl.load(vs_ptr + base * BLOCK + t).to(tl.float32)[None, :]
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m = m_new
        out = acc / total[:, None]
        tl.store(out_ptr + row * out_stride + heads[:, None] * HEAD_DIM + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=in_group[:, None])

    @triton.jit
    def rope_and_cache_kernel(qkv_ptr, qkv_stride, cos_ptr, sin_ptr, slots_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
                              kc_ptr, q_out_ptr, qmax, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                              HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, SCALED: tl.constexpr,
                              INTEGER: tl.constexpr, SMOOTH: tl.constexpr):
        # program (token, head) over heads + 2 kv_heads: q heads rotate into q_out, k heads rotate into the K
        # cache, v heads go to the V cache. SCALED (8-bit caches, model/kv_quant.py): each k and v head-vector
        # divided by its scale, amax / qmax rounded up to bf16, stored in ks_ptr / vs_ptr; INTEGER: int8 values
        # (rounded to nearest even, clamped), else fp8 (the store converts); SMOOTH: kc_ptr [KV_HEADS, HEAD_DIM] are
        # the keys' channel scales, k divided and q multiplied by them
        token = tl.program_id(0)
        head = tl.program_id(1)
        half = tl.arange(0, HEAD_DIM // 2)
        src = qkv_ptr + token * qkv_stride + head * HEAD_DIM
        if head < HEADS + KV_HEADS:
            x1 = tl.load(src + half).to(tl.float32)
            x2 = tl.load(src + HEAD_DIM // 2 + half).to(tl.float32)
            c1 = tl.load(cos_ptr + token * HEAD_DIM + half)
            c2 = tl.load(cos_ptr + token * HEAD_DIM + HEAD_DIM // 2 + half)
            s1 = tl.load(sin_ptr + token * HEAD_DIM + half)
            s2 = tl.load(sin_ptr + token * HEAD_DIM + HEAD_DIM // 2 + half)
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
            if SMOOTH:
                kv_head = tl.where(head < HEADS, head // (HEADS // KV_HEADS), head - HEADS)
                k1 = tl.load(kc_ptr + kv_head * HEAD_DIM + half)
                k2 = tl.load(kc_ptr + kv_head * HEAD_DIM + HEAD_DIM // 2 + half)
                if head < HEADS:
                    y1 = y1 * k1
                    y2 = y2 * k2
                else:
                    y1 = y1 / k1
                    y2 = y2 / k2
            if head < HEADS:
                dst = q_out_ptr + (token * HEADS + head) * HEAD_DIM
                tl.store(dst + half, y1.to(q_out_ptr.dtype.element_ty))
                tl.store(dst + HEAD_DIM // 2 + half, y2.to(q_out_ptr.dtype.element_ty))
            else:
                slot = tl.load(slots_ptr + token)
                block = slot // BLOCK
                offset = slot % BLOCK
                base = (block * KV_HEADS + head - HEADS) * HEAD_DIM * BLOCK + offset  # [D, BLOCK] transposed
                if SCALED:  # the smallest bf16 >= amax / qmax: the float32 bits rounded up at bit 16
                    amax = tl.maximum(tl.max(tl.abs(y1), 0), tl.max(tl.abs(y2), 0))
                    kv_scale = (((amax / qmax).to(tl.int32, bitcast=True) + 0xFFFF) & -65536).to(tl.float32,
                                                                                                  bitcast=True)
                    tl.store(ks_ptr + (block * KV_HEADS + head - HEADS) * BLOCK + offset, kv_scale.to(tl.bfloat16))
                    inverse = tl.where(kv_scale > 0, 1.0 / kv_scale, 0.0)
                    y1 = y1 * inverse
                    y2 = y2 * inverse
                    if INTEGER:  # round half to even: adding and taking away 1.5 * 2^23 does it in float32
                        y1 = (y1 + 12582912.0) - 12582912.0
                        y2 = (y2 + 12582912.0) - 12582912.0
                    y1 = tl.minimum(tl.maximum(y1, -qmax), qmax)
                    y2 = tl.minimum(tl.maximum(y2, -qmax), qmax)
                tl.store(k_ptr + base + half * BLOCK, y1.to(k_ptr.dtype.element_ty))
                tl.store(k_ptr + base + (HEAD_DIM // 2 + half) * BLOCK, y2.to(k_ptr.dtype.element_ty))
        else:
            d = tl.arange(0, HEAD_DIM)
            slot = tl.load(slots_ptr + token)
            block = slot // BLOCK
            offset = slot % BLOCK
            x = tl.load(src + d)
            base = ((block * KV_HEADS + head - HEADS - KV_HEADS) * BLOCK + offset) * HEAD_DIM
            if SCALED:  # as k above
                x = x.to(tl.float32)
                kv_scale = (((tl.max(tl.abs(x), 0) / qmax).to(tl.int32, bitcast=True) + 0xFFFF) & -65536).to(
                    tl.float32, bitcast=True)
                tl.store(vs_ptr + (block * KV_HEADS + head - HEADS - KV_HEADS) * BLOCK + offset,
                         kv_scale.to(tl.bfloat16))
                x = x * tl.where(kv_scale > 0, 1.0 / kv_scale, 0.0)
                if INTEGER:
                    x = (x + 12582912.0) - 12582912.0
                x = tl.minimum(tl.maximum(x, -qmax), qmax)
            tl.store(v_ptr + base + d, x.to(v_ptr.dtype.element_ty))

    @triton.jit
    def token_bitmask_kernel(logits_ptr, logits_stride, rows_ptr, bitmask_ptr, words, vocab,
                             BLOCK: tl.constexpr):
        i = tl.program_id(0)
        chunk = tl.program_id(1)
        tokens = chunk * BLOCK + tl.arange(0, BLOCK)
        inside = tokens < vocab
        word = tl.load(bitmask_ptr + i * words + tokens // 32, mask=inside, other=-1)
        allowed = ((word >> (tokens % 32)) & 1) != 0
        row = tl.load(rows_ptr + i)
        tl.store(logits_ptr + row * logits_stride + tokens, float("-inf"), mask=inside & ~allowed)

    return {"attention": paged_attention_kernel, "rope": rope_and_cache_kernel, "bitmask": token_bitmask_kernel}


def paged_attention(out: torch.Tensor, query: torch.Tensor, cache: LayerKV, query_start: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                    window: int | None = None) -> None:
    """kernels.paged_attention's contract: out/query [T, heads, head_dim] (rows of a sequence contiguous, in
    query_start order), causal within the step's tokens, every cached token before them visible (within
    `window` keys of the query, itself included, when given); the cache in any format of model/kv_quant.py."""
    tokens, heads, head_dim = query.shape
    k_cache, v_cache = cache.k, cache.v
    kv_heads, block = k_cache.shape[1], k_cache.shape[3]
    group = heads // kv_heads
    query_lens = query_start[1:] - query_start[:-1]
    # output_size: no device-to-host sync for the result's length (a CUDA graph captures this)
    row_seq = torch.repeat_interleave(torch.arange(len(seq_lens), device=query.device), query_lens,
                                      output_size=tokens)
    # a row's position: its sequence's length after the step, minus the rows after it in the sequence
    row_pos = seq_lens[row_seq] - (query_start[1:][row_seq] - torch.arange(tokens, device=query.device))
    assert query.stride(2) == 1 and query.stride(1) == head_dim and out.stride(1) == head_dim
    kernel = _kernels()["attention"]
    scaled = cache.k_scale is not None
    kernel[(tokens, kv_heads)](out, query, k_cache, v_cache, cache.k_scale if scaled else k_cache,
                               cache.v_scale if scaled else v_cache, block_tables.contiguous(), row_seq.contiguous(),
                               row_pos.contiguous(), scale, window or 0, query.stride(0), out.stride(0),
                               block_tables.shape[1], KV_HEADS=kv_heads, GROUP=group,
                               GROUP_PAD=max(16, 1 << (group - 1).bit_length()), HEAD_DIM=head_dim, BLOCK=block,
                               SCALED=scaled)


def rope_and_cache(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                   slot_mapping: torch.Tensor, cache: LayerKV) -> torch.Tensor:
    """kernels.rope_and_cache's contract: rotate q and k of the fused projection (rotate-half, full width), store
    k and v at their slots (quantized as they are written in an 8-bit format, k over the channel scales), return
    q [T, heads, head_dim] (times them)."""
    tokens, head_dim = qkv.shape[0], cos.shape[-1]
    assert qkv.stride(1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    fmt = cache.format
    _kernels()["rope"][(tokens, num_heads + 2 * num_kv_heads)](
        qkv, qkv.stride(0), cos.float().contiguous(), sin.float().contiguous(), slot_mapping, cache.k, cache.v,
        cache.k_scale if fmt.scaled else cache.k, cache.v_scale if fmt.scaled else cache.v,
        cache.k if cache.key_channel_scale is None else cache.key_channel_scale, q, fmt.qmax,
        HEADS=num_heads, KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK=cache.k.shape[3], SCALED=fmt.scaled,
        INTEGER=fmt.storage == torch.int8, SMOOTH=cache.key_channel_scale is not None)
    return q


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask row i is clear (token_bitmask.c's contract)."""
    if rows.numel() == 0:
        return
    block = 1024
    vocab = logits.shape[1]
    rows = rows.to(device=logits.device, dtype=torch.int64).contiguous()
    bitmask = bitmask.to(logits.device).contiguous()
    _kernels()["bitmask"][(rows.numel(), -(-vocab // block))](logits, logits.stride(0), rows, bitmask,
                                                              bitmask.shape[1], vocab, BLOCK=block)
