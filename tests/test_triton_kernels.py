"""The GPU path's Triton kernels (kernels/triton_ops.py) against the torch reference, on CPU under Triton's
interpreter: paged attention over mixed batches (decodes only, prompt chunks only, both), GQA ratios 1/4/8,
contexts across block boundaries, sliding windows, float32 / float16 / bfloat16 caches; the fused rope + KV
write; the token bitmask. Triton is an optional extra (`pip install 'tokenmill[triton]'`; `.ci/run` installs
it); small shapes keep the interpreter within seconds.

The interpreter computes `tl.dot` wrongly on bf16 inputs; the kernels load K/V and upcast them to float32 before
every dot, so a bf16 cache is read exactly here as on a GPU."""

from __future__ import annotations

import os
from unittest import mock

import numpy as np
import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
triton = pytest.importorskip("triton")

from tests.conftest import DEVICE  # noqa: E402
from tokenmill.kernels import triton_ops  # noqa: E402
from tokenmill.model import kv_quant  # noqa: E402
from tokenmill.model.attention import AttentionMetadata, paged_attention  # noqa: E402

BLOCK = 16


def _batch(query_lens: list[int], context_lens: list[int], heads: int, kv_heads: int, head_dim: int,
           dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A random flat batch: sequence i has context_lens[i] cached tokens and query_lens[i] new ones, its blocks
    scattered over the pool; the caches hold every token's K/V (new ones included, as after the KV write)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = np.array([c + q for c, q in zip(context_lens, query_lens)])
    blocks_per_seq = [-(-int(n) // BLOCK) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = np.zeros((len(seq_lens), max(blocks_per_seq)), np.int64)
    taken = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = order[taken:taken + n]
        taken += n
    k_cache = torch.randn(num_blocks, kv_heads, head_dim, BLOCK, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(num_blocks, kv_heads, BLOCK, head_dim, generator=gen).to(DEVICE, dtype)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=gen).to(DEVICE)
    positions = np.concatenate([np.arange(c, c + q) for c, q in zip(context_lens, query_lens)])
    seq_of_row = np.repeat(np.arange(len(seq_lens)), query_lens)
    slots = tables[seq_of_row, positions // BLOCK] * BLOCK + positions % BLOCK
    meta = AttentionMetadata.build(np.array(query_lens), seq_lens, tables, slots, BLOCK, torch.device(DEVICE))
    return q, k_cache, v_cache, meta


def _reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, window: int | None) -> torch.Tensor:
    """The torch path (the native CPU kernel kept out) on float32 copies of the caches."""
    from tokenmill import kernels

    k_cache, v_cache = k_cache.float(), v_cache.float()
    blocks, offsets = meta.slot_mapping // BLOCK, meta.slot_mapping % BLOCK
    k_new, v_new = k_cache[blocks, :, :, offsets], v_cache[blocks, :, offsets, :]  # the step's own K/V
    with mock.patch.object(kernels, "attention_supported", return_value=False):
        return paged_attention(q, k_new, v_new, kv_quant.LayerKV(k_cache, v_cache), meta, scale, window)


CASES = {
    "decodes": ([1, 1, 1, 1], [0, 15, 16, 40]),
    "prompt chunks": ([7, 33, 16], [0, 9, 16]),
    "mixed": ([1, 20, 1, 5], [31, 0, 64, 11]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("group", [1, 4, 8])
def test_paged_attention_matches_the_torch_reference(case: str, group: int) -> None:
    query_lens, context_lens = CASES[case]
    kv_heads, head_dim = 2, 32
    q, k_cache, v_cache, meta = _batch(query_lens, context_lens, kv_heads * group, kv_heads, head_dim, torch.float32)
    scale = head_dim ** -0.5
    out = torch.empty_like(q)
    triton_ops.paged_attention(out, q, kv_quant.LayerKV(k_cache, v_cache), meta.query_start,
                               meta.seq_lens, meta.block_tables, scale)
    expected = _reference(q, k_cache, v_cache, meta, scale, None)
    assert torch.allclose(out, expected, rtol=1e-3, atol=1e-4), (out - expected).abs().max()


@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_paged_attention_sliding_window(window: int) -> None:
    q, k_cache, v_cache, meta = _batch([1, 20, 1, 5], [31, 0, 64, 11], 8, 2, 16, torch.float32, seed=window)
    out = torch.empty_like(q)
    triton_ops.paged_attention(out, q, kv_quant.LayerKV(k_cache, v_cache), meta.query_start,
                               meta.seq_lens, meta.block_tables, 0.25,
                               window)
    expected = _reference(q, k_cache, v_cache, meta, 0.25, window)
    assert torch.allclose(out, expected, rtol=1e-3, atol=1e-4), (out - expected).abs().max()
    full = _reference(q, k_cache, v_cache, meta, 0.25, None)
    assert not torch.allclose(full, expected, atol=1e-3), "the window must change the answer"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_half_precision_caches(dtype: torch.dtype) -> None:
    """fp16/bf16 caches, upcast to float32 inside the kernel: the same answer as the float32 reference on the
    same (rounded) cache values, within float32 rounding."""
    q, k_cache, v_cache, meta = _batch([1, 20, 1, 5], [31, 0, 64, 11], 8, 2, 32, dtype, seed=3)
    out = torch.empty_like(q)
    triton_ops.paged_attention(out, q, kv_quant.LayerKV(k_cache, v_cache), meta.query_start,
                               meta.seq_lens, meta.block_tables, 0.2)
    expected = _reference(q, k_cache, v_cache, meta, 0.2, None)
    assert torch.allclose(out, expected, rtol=1e-3, atol=1e-4), (out - expected).abs().max()


def test_rope_and_cache_matches_the_torch_reference() -> None:
    from tokenmill.model.llama import apply_rope

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, tokens = 4, 2, 32, 9
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE)
    angles = torch.rand(tokens, head_dim // 2, generator=gen).to(DEVICE) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    slots = torch.randperm(4 * BLOCK, generator=gen)[:tokens].to(DEVICE)
    k_cache = torch.zeros(4, kv_heads, head_dim, BLOCK, device=DEVICE)
    v_cache = torch.zeros(4, kv_heads, BLOCK, head_dim, device=DEVICE)
    q = triton_ops.rope_and_cache(qkv, heads, kv_heads, cos, sin, slots, kv_quant.LayerKV(k_cache, v_cache))
    q_ref, k_ref, v_ref = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q_ref = apply_rope(q_ref.view(tokens, heads, head_dim), cos[:, None], sin[:, None])
    k_ref = apply_rope(k_ref.view(tokens, kv_heads, head_dim), cos[:, None], sin[:, None])
    k_expected, v_expected = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    kv_quant.write(kv_quant.LayerKV(k_expected, v_expected), k_ref, v_ref.reshape(tokens, kv_heads, head_dim), slots)
    assert torch.allclose(q, q_ref, atol=1e-5)
    assert torch.allclose(k_cache, k_expected, atol=1e-5) and torch.equal(v_cache, v_expected)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_8bit_caches_written_and_read_as_the_torch_reference(name: str) -> None:
    """The rope + KV write quantizes as kv_quant.write does, and the attention over that cache matches the torch
    reference reading the same bytes."""
    from tokenmill.model.attention import allocate_layer_kv
    from tokenmill.model.llama import apply_rope

    fmt = kv_quant.kv_format(name)
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, head_dim, tokens = 8, 2, 32, 40
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE) * 3
    angles = torch.rand(tokens, head_dim // 2, generator=gen).to(DEVICE) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    # two sequences: 25 tokens in blocks 3, 0; 15 tokens in blocks 1, (4)
    tables = np.array([[3, 0], [1, 4]], np.int64)
    positions = np.concatenate([np.arange(25), np.arange(15)])
    seq = np.repeat([0, 1], [25, 15])
    slots = tables[seq, positions // BLOCK] * BLOCK + positions % BLOCK
    cache = allocate_layer_kv(5, BLOCK, kv_heads, head_dim, fmt, torch.device(DEVICE))
    expected = allocate_layer_kv(5, BLOCK, kv_heads, head_dim, fmt, torch.device(DEVICE))
    channels = torch.exp2(torch.randint(-4, 5, (kv_heads, head_dim // 2), generator=gen).float()).repeat(1, 2)
    for c in (cache, expected):  # int8: keys over their channel scales, queries times them
        if c.key_channel_scale is not None:
            c.key_channel_scale.copy_(channels.to(DEVICE))
    q = triton_ops.rope_and_cache(qkv, heads, kv_heads, cos, sin, torch.from_numpy(slots).to(DEVICE), cache)
    q_ref = apply_rope(qkv[:, :heads * head_dim].reshape(tokens, heads, head_dim), cos[:, None], sin[:, None])
    k_ref = apply_rope(qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].reshape(tokens, kv_heads, head_dim),
                       cos[:, None], sin[:, None])
    q_ref, k_ref = kv_quant.smooth_keys(q_ref, k_ref, cache)
    torch.testing.assert_close(q, q_ref, rtol=1e-6, atol=1e-6)
    v_ref = qkv[:, (heads + kv_heads) * head_dim:].reshape(tokens, kv_heads, head_dim)
    kv_quant.write(expected, k_ref, v_ref, torch.from_numpy(slots).to(DEVICE))
    assert torch.equal(cache.k_scale, expected.k_scale) and torch.equal(cache.v_scale, expected.v_scale)
    for got, want in ((cache.k, expected.k), (cache.v, expected.v)):
        if name == "int8":  # the same values, or one apart where the scaled value was a tie either way
            assert torch.all((got.float() - want.float()).abs() <= 1)
            continue
        # the interpreter's fp8 conversion (not a GPU's) drops the carry when rounding up into the next binade:
        # a value that should round to 2^e comes out as 2^(e-1); everywhere else the same bytes
        differ = got.view(torch.uint8) != want.view(torch.uint8)
        mantissa_bits = {"fp8_e4m3": 0x07, "fp8_e5m2": 0x03}[name]
        assert torch.all(want.view(torch.uint8)[differ] & mantissa_bits == 0)
        assert torch.equal(got[differ].float() * 2, want[differ].float())
    meta = AttentionMetadata.build(np.array([25, 15]), np.array([25, 15]), tables, slots, BLOCK,
                                   torch.device(DEVICE))
    out = torch.empty_like(q)
    triton_ops.paged_attention(out, q, cache, meta.query_start, meta.seq_lens, meta.block_tables, head_dim ** -0.5)
    from tokenmill import kernels

    with mock.patch.object(kernels, "attention_supported", return_value=False):
        reference = paged_attention(q, k_ref, v_ref, cache, meta, head_dim ** -0.5, None)
    assert torch.allclose(out, reference, rtol=1e-3, atol=1e-4), (out - reference).abs().max()


def test_token_bitmask() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 2500
    logits = torch.randn(5, vocab, generator=gen).to(DEVICE)
    rows = torch.tensor([0, 3, 4], device=DEVICE)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, -(-vocab // 32)), generator=gen, dtype=torch.int64).to(torch.int32)
    expected = logits.clone()
    bits = ((bitmask.to(torch.int64)[:, :, None] >> torch.arange(32)) & 1).reshape(3, -1)[:, :vocab].bool()
    bits = bits.to(DEVICE)
    for i, row in enumerate(rows.tolist()):
        expected[row][~bits[i]] = float("-inf")
    triton_ops.apply_token_bitmask(logits, rows, bitmask)
    assert torch.equal(logits, expected)


def test_device_selection_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton serves CUDA tensors, and CPU tensors only under the interpreter; TOKENMILL_DISABLE_TRITON turns it
    off; shapes it cannot tile fall back to torch."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_ops.triton_usable(torch.device("cuda")) and triton_ops.triton_usable(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert triton_ops.triton_usable(torch.device("cuda"))
    assert not triton_ops.triton_usable(torch.device("cpu"))
    monkeypatch.setenv("TOKENMILL_DISABLE_TRITON", "1")
    assert not triton_ops.triton_usable(torch.device("cuda"))
    assert triton_ops.attention_shapes_supported(64, 16) and not triton_ops.attention_shapes_supported(80, 16)
    assert not triton_ops.attention_shapes_supported(64, 8)
