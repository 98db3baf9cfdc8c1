"""The native CPU attention kernel against the torch reference path it replaces, and its batch invariance."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from tokenmill import kernels
from tokenmill.model import attention, kv_quant
from tokenmill.model.attention import AttentionMetadata, allocate_layer_kv, paged_attention
from tokenmill.model.kv_quant import format_of, kv_format

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                reason="no C compiler on this machine: the torch fallback serves instead")
CPU = torch.device("cpu")


class Batch:
    """A flat batch over a paged cache whose context K/V are random and whose blocks are shuffled."""

    def __init__(self, seed: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                 seqs: list[tuple[int, int]],  # (query tokens, context length after the step)
                 dtype: torch.dtype = torch.float32) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.block_size, self.seqs = heads, block_size, seqs
        max_blocks = max(-(-n // block_size) for _, n in seqs)
        num_blocks = len(seqs) * max_blocks + 2
        fmt = format_of(torch.empty(0, dtype=dtype))
        self.cache = allocate_layer_kv(num_blocks, block_size, kv_heads, head_dim, fmt, CPU)
        for values, scales in ((self.cache.k, self.cache.k_scale), (self.cache.v, self.cache.v_scale)):
            random = torch.randn(values.shape, generator=gen)
            if scales is None:
                values.copy_(random)
            else:  # each token-head vector quantized: K's run along dimension 2, V's along the last
                along_last = random if values is self.cache.v else random.transpose(2, 3)
                q, s = kv_quant.quantize(along_last, fmt)
                values.copy_(q if values is self.cache.v else q.transpose(2, 3))
                scales.copy_(s)
        order = np.random.RandomState(seed).permutation(num_blocks)[: len(seqs) * max_blocks]
        self.tables = order.reshape(len(seqs), max_blocks).astype(np.int64)
        tokens = sum(q for q, _ in seqs)
        self.q = torch.randn(tokens, heads, head_dim, generator=gen)
        self.k = torch.randn(tokens, kv_heads, head_dim, generator=gen)
        self.v = torch.randn(tokens, kv_heads, head_dim, generator=gen)

    def meta(self, seqs: list[tuple[int, int]] | None = None, tables: np.ndarray | None = None) -> AttentionMetadata:
        seqs = seqs or self.seqs
        tables = self.tables if tables is None else tables
        slots = [tables[i, p // self.block_size] * self.block_size + p % self.block_size
                 for i, (q_len, n) in enumerate(seqs) for p in range(n - q_len, n)]
        query_lens, seq_lens = (np.array(column, np.int64) for column in zip(*seqs))
        return AttentionMetadata.build(query_lens, seq_lens, tables, np.array(slots, np.int64), self.block_size, CPU)

    def run(self, meta: AttentionMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            window: int | None = None) -> torch.Tensor:
        kv_quant.write(self.cache, k, v, meta.slot_mapping)
        return paged_attention(q, k, v, self.cache, meta, q.shape[-1] ** -0.5, window)


SHAPES = [
    (9, 3, 64, 16, [(1, 1), (1, 17), (1, 300), (7, 7), (5, 40), (64, 100), (1, 16)]),  # SmolLM2; block edges
    (8, 8, 128, 32, [(3, 3), (1, 200), (40, 90)]),  # no GQA, another block size and head size
    (16, 2, 32, 1, [(1, 3), (9, 9), (4, 40)]),  # 1-token blocks
]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "seqs"), SHAPES)
def test_native_attention_matches_the_torch_reference(heads, kv_heads, head_dim, block_size, seqs,  # noqa: ANN001
                                                      monkeypatch) -> None:  # noqa: ANN001
    batch = Batch(0, heads, kv_heads, head_dim, block_size, seqs)
    meta = batch.meta()
    supported = kernels.attention_supported(batch.q, batch.q.shape[1], batch.cache)
    assert supported, "the kernel did not build on a machine with gcc"
    native = batch.run(meta, batch.q, batch.k, batch.v)
    monkeypatch.setattr(attention.kernels, "attention_supported", lambda *_: False)
    reference = batch.run(meta, batch.q, batch.k, batch.v)
    torch.testing.assert_close(native, reference, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "seqs"), SHAPES)
@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_native_sliding_window_attention_matches_the_torch_reference(heads, kv_heads, head_dim, block_size,  # noqa: ANN001
                                                                     seqs, window: int, monkeypatch) -> None:  # noqa: ANN001
    """Windows smaller than, equal to and across blocks, over prompt chunks and decodes."""
    batch = Batch(1, heads, kv_heads, head_dim, block_size, seqs)
    meta = batch.meta()
    native = batch.run(meta, batch.q, batch.k, batch.v, window)
    monkeypatch.setattr(attention.kernels, "attention_supported", lambda *_: False)
    reference = batch.run(meta, batch.q, batch.k, batch.v, window)
    torch.testing.assert_close(native, reference, rtol=2e-5, atol=2e-5)
    full = batch.run(meta, batch.q, batch.k, batch.v)
    assert not torch.allclose(reference, full)  # the window changes the answer for these shapes


@pytest.mark.skipif(not kernels.attention_bf16_available(), reason="no AVX-512: bf16 caches take the torch path")
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "seqs"), [
    (9, 3, 64, [(1, 1), (1, 17), (1, 300), (7, 7), (5, 40), (64, 100), (1, 16)]),
    (8, 2, 128, [(3, 3), (1, 200), (40, 90)]),
    (4, 1, 256, [(1, 17), (5, 40), (20, 20)]),  # Gemma 3's shapes
])
@pytest.mark.parametrize("window", [None, 5, 16, 37])
def test_native_attention_over_bf16_caches_matches_the_torch_reference(heads, kv_heads, head_dim, seqs,  # noqa: ANN001
                                                                     window: int | None, monkeypatch) -> None:  # noqa: ANN001
    """Full and sliding-window layers (Gemma 3's)."""
    batch = Batch(4, heads, kv_heads, head_dim, 16, seqs, torch.bfloat16)
    meta = batch.meta()
    assert kernels.attention_supported(batch.q, heads, batch.cache)
    dots = kernels.bf16_dot_attention(batch.cache)
    # bf16 dot products round each query row to bf16 (to nearest even, as torch does): give both sides rounded
    # rows, so that what remains is the softmax weights' rounding
    q = batch.q.bfloat16().float() if dots else batch.q
    native = batch.run(meta, q, batch.k, batch.v, window)
    monkeypatch.setattr(attention.kernels, "attention_supported", lambda *_: False)
    # the reference reads the new tokens' K/V unrounded where a sequence has no cached context: round them too
    k, v = batch.k.bfloat16().float(), batch.v.bfloat16().float()
    reference = batch.run(meta, q, k, v, window)
    if not dots:
        torch.testing.assert_close(native, reference, rtol=2e-5, atol=2e-5)
        return
    # each weight over V off by at most 2^-8 of itself (bf16 keeps 8 significant bits; the denominator sums the
    # unrounded weights): an output is off by at most 2^-8 of the largest value it averages, and the errors are
    # independent, so far less on average (measured: 2^-10.2 at most, 2^-13.5 on average at worst)
    error = (native - reference).abs()
    largest = torch.maximum(v.abs().max(), batch.cache.v.float().abs().max())
    assert error.max() <= 2**-8 * largest and error.mean() <= 2**-12 * largest, (error.max(), error.mean(), largest)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_a_token_gets_bit_identical_attention_whatever_its_chunk_or_batch(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not kernels.attention_bf16_available():
        pytest.skip("no AVX-512: bf16 caches take the torch path")
    batch = Batch(1, 9, 3, 64, 16, [(70, 70), (1, 33), (1, 129)], dtype)
    whole = batch.run(batch.meta(), batch.q, batch.k, batch.v)  # the 70-token prompt in one chunk
    prompt = slice(0, 70)
    chunked = []
    done = 0
    for size in (10, 1, 16, 43):  # the same prompt in chunks, each next to the two decodes
        seqs = [(size, done + size), (1, 33), (1, 129)]
        rows = torch.cat([torch.arange(done, done + size), torch.tensor([70, 71])])
        out = batch.run(batch.meta(seqs), batch.q[rows], batch.k[rows], batch.v[rows])
        chunked.append(out[:size])
        assert torch.equal(out[size:], whole[70:])  # the decodes are unchanged by their neighbour's chunking
        done += size
    assert torch.equal(torch.cat(chunked), whole[prompt])
    alone = Batch(1, 9, 3, 64, 16, [(70, 70), (1, 33), (1, 129)], dtype)  # same data, one sequence per call
    for i, rows in enumerate((slice(0, 70), slice(70, 71), slice(71, 72))):
        meta = alone.meta([alone.seqs[i]], alone.tables[i:i + 1])
        assert torch.equal(alone.run(meta, alone.q[rows], alone.k[rows], alone.v[rows]), whole[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_slots_past_a_sequence_keys_never_reach_its_output(dtype: torch.dtype) -> None:
    """A block's slots past its sequence's last key hold whatever an earlier owner left there: non-finite values
    and scales in them change no output bit (odd key counts: the bf16 sum over V pairs a lone last key with the
    slot after it)."""
    if dtype == torch.bfloat16 and not kernels.attention_bf16_available():
        pytest.skip("no AVX-512: bf16 caches take the torch path")
    seqs = [(1, 17), (3, 35), (5, 41), (1, 129)]
    batch = Batch(3, 9, 3, 64, 16, seqs, dtype)
    meta = batch.meta()
    clean = batch.run(meta, batch.q, batch.k, batch.v)
    cache, garbage = batch.cache, float("nan") if dtype != torch.int8 else 127.0
    for i, (_, length) in enumerate(seqs):
        block, first = int(batch.tables[i, length // 16]), length % 16
        cache.k[block, :, :, first:] = garbage
        cache.v[block, :, first:, :] = garbage
        for scales in (cache.k_scale, cache.v_scale):
            if scales is not None:
                scales[block, :, first:] = float("inf")
    poisoned = batch.run(meta, batch.q, batch.k, batch.v)
    assert torch.isfinite(clean).all() and torch.equal(poisoned, clean)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_decode_attention_is_bit_identical_whether_a_task_takes_one_kv_head_or_all(dtype: torch.dtype) -> None:
    """With enough decodes for the threads, one task takes all of a sequence's kv heads (kernel docstring);
    with more threads than decodes, one kv head each: the same numbers either way."""
    if dtype == torch.bfloat16 and not kernels.attention_bf16_available():
        pytest.skip("no AVX-512: bf16 caches take the torch path")
    batch = Batch(2, 9, 3, 64, 16, [(1, 40), (1, 300), (1, 17), (3, 90)], dtype)
    meta = batch.meta()
    threads = torch.get_num_threads()
    try:
        outs = []
        for count in (1, 16):  # 3 decodes: all heads per task on 1 thread, one head per task on 16
            torch.set_num_threads(count)
            outs.append(batch.run(meta, batch.q, batch.k, batch.v))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_unsupported_shapes_fall_back() -> None:
    query = torch.randn(2, 128, 64)
    float32 = kv_format("float32")
    cache = allocate_layer_kv(4, 16, 1, 64, float32, CPU)
    assert not kernels.attention_supported(query, 128, cache)  # 128 query heads per kv head > 64
    cache = allocate_layer_kv(4, 128, 8, 64, float32, CPU)
    assert not kernels.attention_supported(torch.randn(2, 8, 64), 8, cache)  # blocks of 128 tokens > 64
    cache = allocate_layer_kv(4, 16, 8, 64, kv_format("float16"), CPU)
    assert not kernels.attention_supported(torch.randn(2, 8, 64), 8, cache)  # float16: the torch path


def test_fused_layer_ops_match_the_torch_path() -> None:
    from tokenmill.model.llama import RMSNorm, apply_rope

    assert kernels.layer_ops_supported(torch.zeros(1)), "the layer kernels did not build on a machine with gcc"
    torch.manual_seed(3)
    rows, hidden = 37, 576
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.rand(hidden) * 2
    x, residual = torch.randn(rows, hidden) * 4, torch.randn(rows, hidden)
    expected_sum = x + residual
    expected = norm.weight * (expected_sum * torch.rsqrt(expected_sum.pow(2).mean(-1, keepdim=True) + 1e-5))
    fused_residual = residual.clone()
    torch.testing.assert_close(kernels.add_rms_norm(fused_residual, x, norm.weight, 1e-5), expected,
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(fused_residual, expected_sum)  # the residual stream is updated in place

    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim)
    positions = torch.randint(0, 4000, (rows,))
    angles = positions[:, None].float() * torch.rand(head_dim // 2)[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    slots = torch.randperm(8 * block)[:rows]
    q = kernels.rope_and_cache(qkv, heads, kv_heads, cos, sin, slots,
                               allocate_layer_kv(8, block, kv_heads, head_dim, kv_format("float32"), CPU))
    q_ref, k_ref, v_ref = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q_ref = apply_rope(q_ref.reshape(rows, heads, head_dim), cos[:, None], sin[:, None])
    k_ref = apply_rope(k_ref.reshape(rows, kv_heads, head_dim), cos[:, None], sin[:, None])
    assert torch.equal(q, q_ref)
    # bf16 caches: rounded to nearest even, as torch converts; 8-bit ones quantized as kv_quant.quantize does,
    # int8 keys over their channel scales (queries times them)
    channels = torch.exp2(torch.randint(-4, 5, (kv_heads, head_dim // 2)).float()).repeat(1, 2)
    for name in ("float32", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"):
        cache = allocate_layer_kv(8, block, kv_heads, head_dim, kv_format(name), CPU)
        expected = allocate_layer_kv(8, block, kv_heads, head_dim, kv_format(name), CPU)
        assert (cache.key_channel_scale is not None) == (name == "int8")
        for c in (cache, expected):
            if c.key_channel_scale is not None:
                c.key_channel_scale.copy_(channels)
        q = kernels.rope_and_cache(qkv, heads, kv_heads, cos, sin, slots, cache)
        q_want, k_want = kv_quant.smooth_keys(q_ref, k_ref, cache)
        assert torch.equal(q, q_want), name
        kv_quant.write(expected, k_want, v_ref.reshape(rows, kv_heads, head_dim), slots)
        for got, want in zip(cache.tensors, expected.tensors, strict=True):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name

    gate_up = torch.randn(rows, 2 * 1536) * 3
    gate, up = gate_up.split(1536, -1)
    torch.testing.assert_close(kernels.gated_activation(gate_up, gelu=False), torch.nn.functional.silu(gate) * up,
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kernels.gated_activation(gate_up, gelu=True),  # GeGLU (Gemma)
                               torch.nn.functional.gelu(gate, approximate="tanh") * up, rtol=1e-5, atol=1e-5)

    # QK-norm in place on the q and k parts of the fused projection (strided rows)
    weight = torch.rand(head_dim) + 0.5
    normed = qkv.clone()
    kernels.rms_norm_heads(normed[:, :heads * head_dim], heads, weight, 1e-6)
    kernels.rms_norm_heads(normed[:, heads * head_dim:], kv_heads, weight, 1e-6)
    qk = qkv[:, :(heads + kv_heads) * head_dim].reshape(rows, heads + kv_heads, head_dim)
    expected = weight * (qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(normed[:, :(heads + kv_heads) * head_dim], expected.reshape(rows, -1),
                               rtol=1e-6, atol=1e-6)
    assert torch.equal(normed[:, (heads + kv_heads) * head_dim:], qkv[:, (heads + kv_heads) * head_dim:])  # v


def _grouped_reference(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The grouped int8 linear written out in torch: (q, scales, output). Integer group sums in float64 (exact),
    float32 accumulation over the groups in k order."""
    rows, k = x.shape
    groups = x.reshape(rows, k // 32, 32)
    scales = groups.abs().amax(-1).clamp(min=1e-10) / 127
    q = torch.round(groups / scales[..., None])
    sums = torch.einsum("rgk,ngk->rng", q.double(), qweight.double().reshape(-1, k // 32, 32)).float()
    y = torch.zeros(rows, qweight.shape[0])
    for g in range(k // 32):
        y = y + sums[:, :, g] * scales[:, g:g + 1]
    y = y * weight_scale
    return q.to(torch.int8).reshape(rows, k), scales, y if bias is None else y + bias


@pytest.mark.skipif(not kernels.int8_grouped_available(), reason="this CPU has neither AVX512-VNNI nor AVX2")
@pytest.mark.parametrize(("rows", "k", "n"), [(1, 576, 960), (2, 1536, 576), (13, 576, 200), (64, 64, 33),
                                              (9, 32, 16), (100, 96, 40), (3, 64, 48), (17, 64, 48)])
def test_grouped_int8_linear_matches_its_torch_reference(rows: int, k: int, n: int) -> None:
    from tokenmill.model.quant import make_linear

    torch.manual_seed(rows)
    layer = make_linear("int8", k, n, bias=rows % 2 == 0)
    layer.load(torch.randn(n, k), torch.randn(n) if rows % 2 == 0 else None)
    x = torch.randn(rows, k) * torch.rand(k) * 5
    x[rows // 2, :32] = 0.0  # an all-zero group
    q, scales, expected = _grouped_reference(x, layer.qweight, layer.scale, layer.bias)
    native_q, native_scales, corr = kernels.quantize_groups(x)
    assert torch.equal(native_q, q) and torch.equal(native_scales, scales)
    assert torch.equal(corr, 128 * q.int().reshape(rows, -1, 32).sum(-1))
    assert layer.packed is not None
    out = layer(x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)  # fused vs separate multiply-adds
    # exact integer sums and per-row scales: a row's output is the same alone or in any batch
    for r in (0, rows - 1, rows // 2):
        assert torch.equal(layer(x[r:r + 1]), out[r:r + 1])


@pytest.mark.parametrize("panels", [False, True], ids=["in-place", "panels"])
def test_gguf_blocks_executed_as_stored_match_their_dequantized_product(panels: bool) -> None:
    """Every format the GGUF kernels execute, read in place (gguf_matmul.c) or repacked into 16-row panels
    (gguf_panels.c, AVX512-VNNI or AVX2): the output is the float64 product of the dequantized weights with the
    int8-quantized activations (rounding only), the same for a token alone or at any place in a batch, and
    reordered rows (row_index) give the same rows."""
    from gguf.quants import dequantize

    from tests.test_loader import _blocks_of_every_type

    executed = [b for b in _blocks_of_every_type() if kernels.gguf_matmul_supported(int(b[0]), b[3])]
    if not kernels.int8_grouped_available():
        pytest.skip("no AVX2: GGUF layers run the int8 backend")
    if panels and not kernels.gguf_panels_available():
        pytest.skip("no panel kernel on this CPU: GGUF weights are read in place")
    assert {t.name for t, *_ in executed} == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
    gen = torch.Generator().manual_seed(3)
    for kind, data, rows, cols in executed:
        weight = torch.from_numpy(np.asarray(dequantize(data, kind), dtype=np.float32).reshape(rows, cols))
        x = torch.randn(7, cols, generator=gen)
        q, scales, _ = kernels.quantize_groups(x)
        activations = (q.double().reshape(7, -1, 32) * scales.double().reshape(7, -1, 1)).reshape(7, cols)
        expected = activations @ weight.double().T
        plan = kernels.GGUFMatmulPlan([(data, int(kind), rows, None)], cols, panels=panels)
        assert plan.panels == panels
        got = kernels.gguf_matmul(x, plan)
        assert ((got.double() - expected).abs().max() / expected.abs().max()).item() < 1e-5, kind
        for t in range(7):  # tokens in and out of the 4-token tiles, alone
            assert torch.equal(kernels.gguf_matmul(x[t:t + 1].contiguous(), plan)[0], got[t]), kind
        # stacked with itself, the second copy's rows reordered (a fused projection), with a bias
        order = torch.randperm(rows, generator=gen)
        bias = torch.randn(2 * rows, generator=gen)
        fused = kernels.GGUFMatmulPlan([(data, int(kind), rows, None), (data, int(kind), rows, order)], cols,
                                       panels=panels)
        assert torch.equal(kernels.gguf_matmul(x, fused, bias), torch.cat([got, got[:, order]], dim=1) + bias), kind
