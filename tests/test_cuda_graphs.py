"""CUDA graphs for decode steps (executor/cuda_graphs.py): when they apply, the sizes captured, and, on CPU with
the capture replaced by an eager replay, that the static buffers and the padding rows change no token."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.conftest import DEVICE
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.executor import cuda_graphs
from tokenmill.executor.cuda_graphs import capture_sizes, eager_reason, replay_eagerly
from tokenmill.executor.model_runner import ModelRunner
from tokenmill.model.rope_scaling import RopeScaling

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "1, 2, 3, 4,", "The quick brown fox"]


def test_the_sizes_climb_vllms_ladder_to_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]
    assert capture_sizes(4096)[-1] == 512


def test_graphs_apply_only_to_a_cuda_device_with_the_triton_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    model = ModelConfig(architecture="llama", vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                        num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5,
                        rope_theta=1e4, max_position_embeddings=4096, tie_word_embeddings=False)
    assert eager_reason(EngineConfig(), model) == "not a CUDA device"
    cuda = EngineConfig(device="cuda")
    monkeypatch.setattr(cuda_graphs.triton_ops, "triton_usable", lambda device: False)
    assert eager_reason(cuda, model) == "no Triton attention kernel for this device and shape"
    monkeypatch.setattr(cuda_graphs.triton_ops, "triton_usable", lambda device: device.type == "cuda")
    assert eager_reason(cuda, model) is None
    assert eager_reason(dataclasses.replace(cuda, block_size=8), model) is not None  # tl.dot needs 16
    assert eager_reason(dataclasses.replace(cuda, enforce_eager=True), model) == "--enforce-eager"
    assert eager_reason(dataclasses.replace(cuda, enable_lora=True), model) == "LoRA adapters"
    fp8 = dataclasses.replace(cuda, kv_cache_dtype="fp8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    assert eager_reason(fp8, model) is not None and "fp8" in str(eager_reason(fp8, model))
    assert eager_reason(dataclasses.replace(cuda, kv_cache_dtype="int8"), model) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100
    assert eager_reason(fp8, model) is None
    longrope = dataclasses.replace(model, rope_scaling=RopeScaling(rope_type="dynamic", factor=2.0))
    assert eager_reason(cuda, longrope) == "length-dependent rope scaling"


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the real capture runs (benchmarks/gpu_check.sh)")
def test_replayed_decode_batches_give_the_eager_tokens(llm: LLM) -> None:
    """Decode batches go through the static buffers, padded to the captured sizes (5 rows run as 8, 3 as 4),
    the padding rows writing into the scratch block: every greedy token is the eager engine's."""
    params = [SamplingParams(max_tokens=6 + 5 * i, temperature=0, ignore_eos=True) for i in range(len(PROMPTS))]
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    graphed = LLM(device=DEVICE, quantization="none")
    runner = graphed.engine.core.executor
    assert isinstance(runner, ModelRunner) and runner.decode_graphs is None  # CPU: eager unless asked
    runner.capture_decode_graphs([1, 2, 4, 8], replay_eagerly)
    assert runner.decode_graphs is not None
    got = [o.outputs[0].token_ids for o in graphed.generate(PROMPTS, params)]
    assert got == expected
    assert runner.decode_graphs.replayed >= sum(p.max_tokens for p in params) // len(PROMPTS)
    assert runner.scratch_block == runner.num_kv_blocks  # past the pool the scheduler allocates from
