"""The engine over 8-bit KV caches: everything that touches KV blocks gives the tokens the plain run gives (prefix
hits, chunked prefill, preemption, speculative decoding, prompt logprobs, LoRA), the native decoder stack equals
the layer-by-layer path, and the start-up line and /metrics name the dtype and the pool's token capacity."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tests.conftest import LONG_PARAGRAPH
from tests.test_spec_decode import _run
from tokenmill import LLM, SamplingParams, kernels
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.executor.model_runner import ModelRunner


def _engine(loaded_model, tokenizer, **config) -> LLMEngine:  # noqa: ANN001, ANN003
    return LLMEngine.from_loaded(EngineConfig(quantization="int8", **config), loaded_model, tokenizer)


pytestmark = pytest.mark.skipif(not kernels.native_attention_available(), reason="no C compiler")
KV_8BIT = ["int8", "fp8_e4m3"]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:  # noqa: ANN001
    shared = "You are a careful assistant. " + LONG_PARAGRAPH * 2
    texts = [shared + " Summarize it.", shared + " Translate it.", "def fibonacci(n):", "The capital of France is",
             "Once upon a time, in a land far away,", "Repeat after me: " + LONG_PARAGRAPH]
    return [tokenizer.encode(t) for t in texts]


@pytest.mark.parametrize("kv", KV_8BIT)
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefix_hits_chunks_preemption_and_speculation_give_the_plain_tokens(loaded_model, tokenizer, prompts,  # noqa: ANN001
                                                                             kv: str, block_size: int) -> None:
    params = SamplingParams(max_tokens=40, temperature=0)
    plain = _run(_engine(loaded_model, tokenizer, kv_cache_dtype=kv, block_size=block_size),
                 prompts, params)
    # a small token budget chunks the prompts, a small pool preempts, the second pass hits the prefix cache,
    # and n-gram speculation verifies several tokens a step
    squeezed = _engine(loaded_model, tokenizer, kv_cache_dtype=kv, block_size=block_size,
                       max_num_batched_tokens=48, num_kv_blocks=-(-(max(map(len, prompts)) + 40) // block_size) + 1,
                       speculative_config={"num_speculative_tokens": 4})
    for _ in range(2):
        outputs = _run(squeezed, prompts, params)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    scheduler = squeezed.core.scheduler
    assert scheduler.total_preemptions > 0 and squeezed.core.kv.prefix_hits > 0
    assert scheduler.spec.accepted_tokens > 0
    assert squeezed.core.kv.num_free_blocks == squeezed.core.kv.num_blocks  # nothing leaked


def test_prompt_logprobs_over_an_int8_cache_are_the_same_chunked_or_whole(prompts) -> None:  # noqa: ANN001
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3)
    whole = LLM(quantization="int8", kv_cache_dtype="int8")
    chunked = LLM(quantization="int8", kv_cache_dtype="int8", max_num_batched_tokens=32)
    for a, b in zip(whole.generate([{"prompt_token_ids": p} for p in prompts], params),
                    chunked.generate([{"prompt_token_ids": p} for p in prompts], params), strict=True):
        assert a.prompt_logprobs == b.prompt_logprobs


@pytest.mark.skipif(not kernels.decoder_stack_available(), reason="no AVX2/AVX512-VNNI: the layers run one by one")
@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_the_native_stack_over_8bit_caches_equals_the_layers(loaded_model, kv: str,  # noqa: ANN001
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenmill.model import llama

    config = EngineConfig(quantization="int8", kv_cache_dtype=kv, num_kv_blocks=32)
    prompt = list(range(100, 400))
    fast = ModelRunner(config, loaded_model.config, loaded_model.weights)
    assert fast.model._stack is not None
    logits = fast.prompt_logits(prompt)
    monkeypatch.setattr(llama.NativeDecoderStack, "supported", staticmethod(lambda model: False))
    slow = ModelRunner(config, loaded_model.config, loaded_model.weights)
    assert torch.equal(slow.prompt_logits(prompt), logits)


def test_an_adapter_over_an_int8_cache_gives_its_tokens_alone_and_batched(tmp_path: Path, prompts,  # noqa: ANN001
                                                                         hf_model) -> None:  # noqa: ANN001
    from tests.test_lora import ADAPTERS, _make_adapter
    from tokenmill import LoRARequest

    adapter = _make_adapter(hf_model, tmp_path / "a", 1, **ADAPTERS["mlp-r4"])
    llm = LLM(quantization="int8", kv_cache_dtype="int8", enable_lora=True, max_loras=2)
    params = SamplingParams(max_tokens=24, temperature=0)
    lora = LoRARequest("a", 1, str(adapter))
    requests = [{"prompt_token_ids": p} for p in prompts]
    batched = llm.generate(requests, params, lora_request=[lora if i % 2 else None for i in range(len(prompts))])
    for i, (request, output) in enumerate(zip(requests, batched)):
        alone = llm.generate(request, params, lora_request=lora if i % 2 else None)[0]
        assert alone.outputs[0].token_ids == output.outputs[0].token_ids
    base = llm.generate(requests[1], params)[0]
    assert base.outputs[0].token_ids != batched[1].outputs[0].token_ids  # the adapter changes the answer


def test_the_startup_line_and_metrics_give_the_dtype_and_token_capacity(caplog: pytest.LogCaptureFixture) -> None:
    from prometheus_client import generate_latest

    from tokenmill.engine.replica import ThreadReplica
    from tokenmill.server.metrics import EngineMetrics

    with caplog.at_level(logging.INFO):
        llm = LLM(quantization="int8", kv_cache_dtype="int8", kv_cache_memory_gb=0.25)
    runner = llm.engine.core.executor
    assert isinstance(runner, ModelRunner)
    tokens = runner.num_kv_blocks * runner.block_size
    assert f"KV cache int8: {tokens:,} tokens" in caplog.text
    bf16 = LLM(quantization="int8", kv_cache_dtype="bfloat16", kv_cache_memory_gb=0.25).engine.core.executor
    assert isinstance(bf16, ModelRunner)
    assert tokens / (bf16.num_kv_blocks * bf16.block_size) == pytest.approx(128 / 66, rel=1e-3)
    info = ThreadReplica(0, llm.engine.core).launch()
    metrics = EngineMetrics("m")
    metrics.on_cache_config(0, info)
    text = generate_latest(metrics.registry).decode()
    assert (f'tokenmill:cache_config_info{{block_size="16",cache_dtype="int8",model_name="m",'
            f'num_blocks="{runner.num_kv_blocks}",replica="0"}} 1.0') in text
    assert f'tokenmill:kv_cache_capacity_tokens{{model_name="m",replica="0"}} {float(tokens)}' in text
