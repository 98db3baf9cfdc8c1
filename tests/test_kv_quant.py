"""8-bit KV caches (model/kv_quant.py): the native kernels against a float64 reference on the dequantized
cache, their generic (non-AVX-512) build too, the quantization's error bound, the pool's capacity and the
refusals."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.test_kernels import CPU, Batch
from tokenmill import kernels
from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.executor import model_runner
from tokenmill.kernels import kv_attention
from tokenmill.model import kv_quant
from tokenmill.model.attention import allocate_layer_kv
from tokenmill.model.kv_quant import LayerKV, kv_format

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler: the torch fallback serves")
# SmolLM2-135M's shapes: head_dim 64
MODEL = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
                    max_position_embeddings=8192, tie_word_embeddings=True)
FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]
DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SHAPES = [
    (9, 3, 64, 16, [(1, 1), (1, 17), (1, 300), (7, 7), (5, 40), (64, 100), (1, 16)]),  # the AVX-512 path; GQA 3
    (8, 2, 128, 16, [(3, 3), (1, 200), (40, 90)]),  # head_dim 128, GQA 4
    (8, 8, 128, 32, [(3, 3), (1, 200), (40, 90)]),  # blocks of 32: the generic path; no GQA
    (16, 2, 32, 1, [(1, 3), (9, 9), (4, 40)]),  # 1-token blocks, GQA 8
]


def dequantized(cache: LayerKV) -> tuple[torch.Tensor, torch.Tensor]:
    """K [blocks, kv_heads, head_dim, block] and V [blocks, kv_heads, block, head_dim] in float64."""
    assert cache.k_scale is not None and cache.v_scale is not None
    k = cache.k.double() * cache.k_scale.double()[:, :, None, :]
    v = cache.v.double() * cache.v_scale.double()[..., None]
    return k, v


def reference_attention(batch: Batch, q: torch.Tensor, window: int | None) -> torch.Tensor:
    """float64 causal (windowed) attention of every query row over the dequantized cache; where the kernel runs an
    int8 cache with integer scores, over the query rows as it quantizes them (amax / 127 per head)."""
    k_cache, v_cache = dequantized(batch.cache)
    if kernels.integer_attention(batch.cache):
        scale = q.abs().amax(-1, keepdim=True) / 127
        q = torch.round(q * torch.where(scale > 0, 127 / q.abs().amax(-1, keepdim=True), 0)).double() * scale.double()
    block = batch.block_size
    group = q.shape[1] // k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    row = 0
    for i, (q_len, seq_len) in enumerate(batch.seqs):
        table = torch.from_numpy(batch.tables[i])
        positions = torch.arange(seq_len)
        keys = k_cache[table[positions // block], :, :, positions % block]  # [seq, kv_heads, head_dim]
        values = v_cache[table[positions // block], :, positions % block, :]
        for j in range(q_len):
            p = seq_len - q_len + j
            seen = (positions <= p) & (positions > p - window if window else positions >= 0)
            for h in range(q.shape[1]):
                scores = keys[seen, h // group] @ q[row + j, h].double() * q.shape[-1] ** -0.5
                out[row + j, h] = torch.softmax(scores, 0) @ values[seen, h // group]
        row += q_len
    return out


def check_against_reference(name: str, shape: tuple, window: int | None) -> None:
    heads, kv_heads, head_dim, block_size, seqs = shape
    batch = Batch(7, heads, kv_heads, head_dim, block_size, seqs, DTYPES[name])
    meta = batch.meta()
    assert kernels.attention_supported(batch.q, heads, batch.cache)
    native = batch.run(meta, batch.q, batch.k, batch.v, window)  # writes this step's K/V (quantized) first
    expected = reference_attention(batch, batch.q, window)
    error, largest = (native.double() - expected).abs(), dequantized(batch.cache)[1].abs().max()
    if kernels.bf16_softmax_weights(batch.cache):
        # the weights over V rounded to bf16, each off by at most 2^-8 of itself: an output by 2^-8 of the largest
        # value it averages at most, far less on average (measured: 2^-10.1 and 2^-14.3; the reference rounds the
        # queries of integer scores as the kernel does)
        assert error.max() <= 2**-8 * largest and error.mean() <= 2**-12 * largest, (error.max(), error.mean())
    elif kernels.integer_attention(batch.cache):
        # float32 rounding alone (measured: 1.7e-7 of the largest value at most, 7e-9 on average)
        assert error.max() <= 1e-6 * largest and error.mean() <= 1e-7 * largest, (error.max(), error.mean())
    else:
        torch.testing.assert_close(native.double(), expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=["hd64-b16", "hd128-b16", "hd128-b32", "hd32-b1"])
@pytest.mark.parametrize("window", [None, 5, 37])
def test_native_attention_over_8bit_caches_matches_float64_on_the_dequantized_cache(name: str, shape: tuple,
                                                                                     window: int | None) -> None:
    check_against_reference(name, shape, window)


AVX2 = ["-march=native", "-mno-avx512f"]


def use_build(flags: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention kernel built with these flags swapped in for this test (float arithmetic there)."""
    source = Path(kernels.__file__).parent / "paged_attention.c"
    library = tmp_path / "paged_attention_other.so"
    subprocess.run(["gcc", "-O3", *flags, "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c11",
                    str(source), "-o", str(library), "-lm"], check=True)
    fn = ctypes.CDLL(str(library)).paged_attention
    fn.argtypes, fn.restype = kv_attention._attention_fn().argtypes, None
    monkeypatch.setattr(kv_attention, "_attention_fn", lambda: fn)
    monkeypatch.setattr(kernels, "integer_attention", lambda cache: False)
    monkeypatch.setattr(kernels, "bf16_softmax_weights", lambda cache: False)


@pytest.fixture(params=[AVX2, ["-march=x86-64"]], ids=["avx2", "generic"])
def other_build(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The paths other hosts run: without AVX-512 (the AVX2 block path, attention_avx2.h) and any x86-64 (a block
    at a time into an L1 tile)."""
    use_build(request.param, tmp_path, monkeypatch)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("window", [None, 37])
def test_other_builds_over_8bit_caches_match_float64(name: str, window: int | None, other_build: None) -> None:
    check_against_reference(name, SHAPES[0], window)
    check_against_reference(name, SHAPES[1], window)
    check_against_reference(name, SHAPES[2], window)


def test_the_avx2_build_is_batch_invariant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A token's attention over an int8 cache is bit-identical alone and next to other sequences there too."""
    use_build(AVX2, tmp_path, monkeypatch)
    batch = Batch(3, 9, 3, 64, 16, [(40, 40), (1, 33), (1, 129)], torch.int8)
    whole = batch.run(batch.meta(), batch.q, batch.k, batch.v)
    for i, rows in enumerate((slice(0, 40), slice(40, 41), slice(41, 42))):
        meta = batch.meta([batch.seqs[i]], batch.tables[i:i + 1])
        assert torch.equal(batch.run(meta, batch.q[rows], batch.k[rows], batch.v[rows]), whole[rows])


@pytest.mark.parametrize("name", FORMATS)
def test_quantization_error_is_bounded_by_the_format(name: str) -> None:
    fmt = kv_format(name)
    x = torch.randn(500, 64) * torch.rand(500, 1) * 30
    x[3] = 0.0  # an all-zero vector: scale 0, values 0
    x[4, 5] = 1e-30  # far below the others' resolution
    values, scales = kv_quant.quantize(x, fmt)
    assert values.dtype == fmt.storage and scales.dtype == torch.bfloat16
    restored = kv_quant.dequantize(values, scales[:, None])
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.all(scales.float()[:, None] * fmt.qmax >= amax)  # rounded up: nothing clips
    # int8: half a step of the scale; fp8: half a unit in the last place (2^-3 e4m3, 2^-2 e5m2 relative)
    relative = {"int8": 0.0, "fp8_e4m3": 2.0**-4, "fp8_e5m2": 2.0**-3}[name]
    step = scales.float()[:, None] * (0.5 if name == "int8" else 2.0 ** (-9 if name == "fp8_e4m3" else -16) / 2)
    assert torch.all((restored - x).abs() <= x.abs() * relative + step + 1e-12)
    assert torch.equal(restored[3], torch.zeros(64))


def test_an_8bit_pool_holds_about_twice_the_tokens_of_bfloat16_in_the_same_memory() -> None:
    blocks = {name: model_runner.num_kv_blocks_for(EngineConfig(kv_cache_dtype=name, kv_cache_memory_gb=1.0),
                                                   MODEL) for name in ("float32", "bfloat16", *FORMATS)}
    # 64 one-byte values and a 2-byte scale per token and head against 128 bytes: 128/66 = 1.94x
    for name in FORMATS:
        assert blocks[name] / blocks["bfloat16"] == pytest.approx(128 / 66, rel=1e-3)
        assert blocks[name] / blocks["float32"] == pytest.approx(256 / 66, rel=1e-3)
    layer = allocate_layer_kv(2, 16, MODEL.num_kv_heads, MODEL.head_dim, kv_format("int8"), CPU)
    assert layer.block_bytes * MODEL.num_layers == model_runner.kv_bytes_per_block(MODEL, 16, kv_format("int8"))


def test_unknown_or_unrunnable_kv_dtypes_are_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="int8, fp8, fp8_e4m3, fp8_e5m2"):
        EngineConfig(kv_cache_dtype="q4_0")
    with pytest.raises(ValueError, match="unknown KV cache dtype 'fp4'.*int8"):
        kv_format("fp4")
    with pytest.raises(ValueError, match="runs on cpu and cuda, not mps"):
        model_runner.kv_cache_format(EngineConfig(device="mps", kv_cache_dtype="int8"), MODEL)
    assert kv_format("fp8") is kv_format("fp8_e4m3")  # vLLM's fp8
