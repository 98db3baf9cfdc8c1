"""The device-selection logic of the GPU path, checked without a GPU: what `auto` resolves to, which kernels
serve a CUDA layer, how the KV pool is sized from the device's memory."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.executor import model_runner
from tokenmill.kernels import triton_ops
from tokenmill.model import quant

MODEL = ModelConfig(architecture="llama", vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_layers=16,
                    num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4,
                    max_position_embeddings=4096, tie_word_embeddings=False)


def test_auto_is_bf16_on_a_gpu_that_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert quant.resolve_quantization("auto", "cuda") == "bf16"
    assert quant.resolve_quantization("none", "cuda") == "none"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert quant.resolve_quantization("auto", "cuda") == "none"
    with pytest.raises(ValueError, match="CPU only"):
        quant.resolve_quantization("int8", "cuda")


def test_kv_cache_is_bf16_under_bf16_linears_where_triton_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(triton_ops, "triton_usable", lambda device: device.type == "cuda")
    config = EngineConfig(device="cuda")
    assert model_runner.linear_mode(config) == "bf16"
    assert model_runner.kv_cache_format(config, MODEL).name == "bfloat16"
    assert model_runner.kv_cache_format(EngineConfig(device="cuda", quantization="none"), MODEL).name == "float32"
    monkeypatch.setattr(triton_ops, "triton_usable", lambda device: False)  # torch fallback: the model's dtype
    assert model_runner.kv_cache_format(config, MODEL).name == "float32"
    assert model_runner.kv_cache_format(EngineConfig(device="cuda", dtype="bfloat16"), MODEL).name == "bfloat16"


def test_triton_layer_selection_needs_cuda_and_tileable_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenmill.model.attention import gpu_kernels_apply
    from tokenmill.model.kv_quant import LayerKV

    monkeypatch.setattr(triton_ops, "triton_usable", lambda device: True)
    cache = LayerKV(torch.empty(1, 2, 64, 16), torch.empty(1, 2, 16, 64))
    assert not gpu_kernels_apply(torch.empty(1, 8), cache)  # a CPU tensor keeps the CPU kernels
    on_gpu = SimpleNamespace(device=torch.device("cuda"))  # only its device is read
    fp8 = LayerKV(torch.empty(1, 2, 64, 16, dtype=torch.float8_e4m3fn), torch.empty(1, 2, 16, 64,
                                                                                  dtype=torch.float8_e4m3fn))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert gpu_kernels_apply(on_gpu, cache) and not gpu_kernels_apply(on_gpu, fp8)  # Triton's fp8 needs 8.9
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert gpu_kernels_apply(on_gpu, fp8)
    assert triton_ops.attention_shapes_supported(64, 16) and not triton_ops.attention_shapes_supported(96, 16)


def test_gpu_kv_pool_takes_what_the_utilization_leaves() -> None:
    gib = 2**30
    config = EngineConfig(device="cuda", gpu_memory_utilization=0.9, max_num_seqs=64, max_num_batched_tokens=512,
                          enforce_eager=True)
    budget = model_runner.gpu_kv_budget(free=70 * gib, total=80 * gib, config=config, model=MODEL)
    activations = 2**28 + 16 * 512 * 8192 * 4 + 2 * 256 * 32000 * 4
    assert budget == int(80 * gib * 0.9) - 10 * gib - activations
    graphs = dataclasses.replace(config, enforce_eager=False)  # the decode graphs' pool: 64 rows' activations
    assert model_runner.gpu_kv_budget(free=70 * gib, total=80 * gib, config=graphs, model=MODEL) == (
        budget - 16 * 64 * 8192 * 4)
    assert model_runner.gpu_kv_budget(free=1 * gib, total=80 * gib, config=config, model=MODEL) == 0
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
