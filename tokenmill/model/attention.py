"""Paged attention over a flat batch: a clear torch reference that runs on CPU and CUDA.

The KV cache of one layer is two tensors [num_blocks, block_size, num_kv_heads, head_dim]. A sequence's
logical token i lives in physical block `block_table[i // block_size]` at offset `i % block_size`; blocks of a
sequence need not be contiguous or ordered. Each step first writes the new tokens' K/V at their slots
(`slot_mapping`), then every sequence attends over its own blocks: causally within the newly scheduled tokens
and fully over its cached context.

Sequences with one query token (decodes) are attended in one batched call; sequences with several query tokens
(prompt chunks) one call each, since padding a 512-token chunk against 63 decodes would waste 64x the work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSlice:
    """A sequence with more than one query token in this step."""

    start: int  # first row of its tokens in the flat batch
    end: int
    seq_len: int  # context length after this step (cached + new tokens)
    block_table: torch.Tensor  # [num_blocks_of_seq] physical block ids
    mask: torch.Tensor | None  # [q_len, seq_len] bool; None when there is no cached context (plain causal)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset) of every new token
    decode_rows: torch.Tensor  # [Bd] flat rows of single-token sequences
    decode_block_tables: torch.Tensor  # [Bd, max_blocks]
    decode_mask: torch.Tensor  # [Bd, 1, 1, max_blocks * block_size] bool: key index < seq_len
    prefills: list[PrefillSlice]
    block_size: int

    @staticmethod
    def build(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSlice] = []
        start = 0
        for q_len, seq_len, table in zip(query_lens, seq_lens, block_tables):
            num_blocks = -(-seq_len // block_size)
            if q_len == 1:
                decode_rows.append(start)
                decode_tables.append(table[:num_blocks])
                decode_lens.append(seq_len)
            else:
                mask = None
                if seq_len != q_len:
                    # query i sits at absolute position seq_len - q_len + i and sees keys up to it.
                    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
                    mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
                prefills.append(
                    PrefillSlice(start, start + q_len, seq_len,
                                 torch.tensor(table[:num_blocks], dtype=torch.long, device=device), mask)
                )
            start += q_len
        max_blocks = max((len(t) for t in decode_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in decode_tables]
        keys = torch.arange(max_blocks * block_size, device=device)
        lens = torch.tensor(decode_lens, dtype=torch.long, device=device)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            decode_rows=torch.tensor(decode_rows, dtype=torch.long, device=device),
            decode_block_tables=torch.tensor(padded, dtype=torch.long, device=device).reshape(
                len(padded), max_blocks
            ),
            decode_mask=(keys[None, :] < lens[:, None])[:, None, None, :],
            prefills=prefills,
            block_size=block_size,
        )


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V ([T, kv_heads, head_dim]) at their slots."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim] (already written to the cache)
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if meta.decode_rows.numel():
        bsz, max_blocks = meta.decode_block_tables.shape
        # [B, max_blocks, block, kvh, hd] -> [B, kvh, L, hd]
        keys = k_cache[meta.decode_block_tables].reshape(bsz, -1, num_kv_heads, head_dim).transpose(1, 2)
        values = v_cache[meta.decode_block_tables].reshape(bsz, -1, num_kv_heads, head_dim).transpose(1, 2)
        query = q[meta.decode_rows].unsqueeze(2)  # [B, heads, 1, hd]
        attn = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        )
        out[meta.decode_rows] = attn.squeeze(2)
    for p in meta.prefills:
        # 4-D [1, heads, q, hd] inputs: torch's CPU flash kernel only takes batched 4-D tensors; 3-D ones fall
        # back to the math path, which is 6x slower on a 3,000-token prompt.
        query = q[p.start:p.end].transpose(0, 1).unsqueeze(0)
        if p.mask is None:  # no cached context: the new tokens are the whole sequence
            keys = k[p.start:p.end].transpose(0, 1).unsqueeze(0)
            values = v[p.start:p.end].transpose(0, 1).unsqueeze(0)
            attn = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale,
                                                  enable_gqa=True)
        else:
            keys = k_cache[p.block_table].reshape(-1, num_kv_heads, head_dim)[: p.seq_len].transpose(0, 1)
            values = v_cache[p.block_table].reshape(-1, num_kv_heads, head_dim)[: p.seq_len].transpose(0, 1)
            attn = F.scaled_dot_product_attention(query, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=p.mask,
                                                  scale=scale, enable_gqa=True)
        out[p.start:p.end] = attn[0].transpose(0, 1)
    return out
