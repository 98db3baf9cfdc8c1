"""Quality gate of the quantized modes (int8, bf16) against the float32 model on the same weights.

- teacher-forced top-1 agreement with float32 >= 97% over the parity prompts and their float32 continuations;
- perplexity on a fixed text (tests/data/perplexity.txt) within +2% of float32;
- the linear backends themselves: int8 is exactly the integer product of its quantized operands.
Batch invariance per mode lives in test_batch_invariance.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.conftest import CHAT_PROMPTS, DEVICE, PLAIN_PROMPTS
from tokenmill import kernels
from tokenmill.config import EngineConfig
from tokenmill.executor.model_runner import ModelRunner
from tokenmill.model.gguf_linear import GGUFLinear
from tokenmill.model.int8_linear import Int8Linear, dequantize_two_level, quantize_rows, quantize_two_level
from tokenmill.model.quant import make_linear, resolve_quantization
from tokenmill.platform import cpu_flags
from tokenmill.sampling_params import SamplingParams

MODES = ["int8", "bf16", "gguf"]  # gguf: the bundled file's Q4_1/Q8_0 blocks executed as stored
CONTINUATION = 48
TEXT = Path(__file__).parent / "data" / "perplexity.txt"


def _runner(loaded_model, mode: str) -> ModelRunner:  # noqa: ANN001
    return ModelRunner(EngineConfig(num_kv_blocks=80, device=DEVICE, quantization=mode), loaded_model.config,
                       loaded_model.weights)


@pytest.fixture(scope="module")
def float_runner(loaded_model) -> ModelRunner:  # noqa: ANN001
    return _runner(loaded_model, "none")


@pytest.fixture(scope="module")
def sequences(llm, tokenizer) -> list[list[int]]:  # noqa: ANN001
    """Each parity prompt followed by the float32 model's own greedy continuation."""
    prompts = [tokenizer.encode(p) for p in PLAIN_PROMPTS] + [tokenizer.encode_chat(m) for m in CHAT_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=CONTINUATION, min_tokens=CONTINUATION)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(p) + list(out.outputs[0].token_ids) for p, out in zip(prompts, outputs)]


def _perplexity(runner: ModelRunner, ids: list[int]) -> float:
    logits = runner.prompt_logits(ids)[:-1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:], device=logits.device))
    return math.exp(nll.item())


@pytest.mark.parametrize("mode", MODES)
def test_teacher_forced_top1_agreement_with_float32(mode: str, loaded_model, float_runner, sequences) -> None:  # noqa: ANN001
    runner = _runner(loaded_model, mode)
    agree = total = 0
    for ids in sequences:
        expected = float_runner.prompt_logits(ids).argmax(-1)
        got = runner.prompt_logits(ids).argmax(-1)
        agree += int((expected == got).sum())
        total += len(ids)
    assert total > 2500
    print(f"{mode}: top-1 agreement with float32 {agree / total:.4f} over {total} positions")
    assert agree / total >= 0.97, f"{mode}: top-1 agreement {agree / total:.4f} over {total} positions"


@pytest.mark.parametrize("mode", MODES)
def test_perplexity_within_two_percent_of_float32(mode: str, loaded_model, float_runner, tokenizer) -> None:  # noqa: ANN001
    ids = tokenizer.encode(TEXT.read_text())
    assert len(ids) > 500
    reference = _perplexity(float_runner, ids)
    quantized = _perplexity(_runner(loaded_model, mode), ids)
    print(f"{mode}: perplexity {quantized:.3f} vs float32 {reference:.3f}")
    assert 1.0 < reference < 100.0  # the model reads English: the gate compares two sane numbers
    assert quantized <= reference * 1.02, f"{mode}: perplexity {quantized:.3f} vs float32 {reference:.3f}"


def test_quantized_modes_really_differ_from_float32(loaded_model, float_runner, sequences) -> None:  # noqa: ANN001
    """Guard on the gate: the quantized logits are not float32 logits in disguise."""
    ids = sequences[-1]
    reference = float_runner.prompt_logits(ids)
    for mode in MODES:
        diff = (_runner(loaded_model, mode).prompt_logits(ids) - reference).abs().max().item()
        assert diff > 1e-3, mode


def test_two_level_int8_linear_is_the_exact_integer_product_of_both_activation_levels() -> None:
    torch.manual_seed(0)
    weight, x = torch.randn(48, 64), torch.randn(5, 64) * torch.rand(64) * 3
    layer = make_linear("int8", 64, 48)
    layer.load(weight)
    assert isinstance(layer, Int8Linear)
    layer.packed = None  # the two-level path of CPUs without AVX512-VNNI (the grouped one: test_kernels.py)
    q1, s1 = quantize_rows(x)
    q2, s2 = quantize_rows(x - q1.float() * s1)  # the residual, quantized again
    wq, ws = quantize_rows(weight)
    w = wq.double().T
    expected = ((q1.double() @ w) * s1.double() + (q2.double() @ w) * s2.double()) * ws.double().T
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-6, atol=1e-6)
    # two levels keep activations at ~14 bits: the error is the weights' alone (~0.5%)
    weight_only = x @ (wq.float() * ws).T
    assert ((layer(x) - weight_only).norm() / weight_only.norm()).item() < 1e-3
    rel = (layer(x) - x @ weight.T).norm() / (x @ weight.T).norm()
    assert 1e-4 < rel < 0.02
    # a row's result does not depend on the other rows (per-row scales, exact integer accumulation)
    assert torch.equal(layer(x[2:3]), layer(x)[2:3])


@pytest.mark.skipif(not kernels.int8_rows_available(), reason="no C compiler: only the torch path exists here")
def test_native_int8_row_kernels_equal_the_torch_path() -> None:
    torch.manual_seed(2)
    x = torch.randn(33, 576) * torch.rand(576) * 10
    x[3] = 0.0  # an all-zero row
    native_q, native_scales = kernels.quantize_two_level(x)
    torch_q, torch_scales = quantize_two_level(x)
    assert torch.equal(native_q, torch_q) and torch.equal(native_scales, torch_scales)
    layer = make_linear("int8", 576, 40, bias=True)
    layer.load(torch.randn(40, 576), torch.randn(40))
    acc = torch._int_mm(native_q, layer.qweight.t())
    assert torch.equal(kernels.dequantize_two_level(acc, native_scales, layer.scale, layer.bias),
                       dequantize_two_level(acc, torch_scales, layer.scale, layer.bias))


def test_quantize_rows_bounds_and_zero_rows() -> None:
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5]])
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert torch.equal(q[0], torch.zeros(3, dtype=torch.int8))
    assert q[1, 1] == -127
    torch.testing.assert_close(q.float() * scale, x, atol=2.0 / 127, rtol=0)


def test_bias_and_tied_rows_per_backend() -> None:
    torch.manual_seed(1)
    weight, bias, x = torch.randn(8, 16), torch.randn(8), torch.randn(3, 16)
    for mode, tol in (("none", 1e-6), ("bf16", 3e-2), ("int8", 3e-2)):
        layer = make_linear(mode, 16, 8, bias=True)
        layer.load(weight, bias)
        expected = x @ weight.T + bias
        assert (layer(x) - expected).abs().max() <= tol * expected.abs().max(), mode
        rows = layer.rows(torch.tensor([3, 0]))
        assert (rows - weight[[3, 0]]).abs().max() <= tol * weight.abs().max(), mode
    with pytest.raises(ValueError, match="shape"):
        make_linear("int8", 16, 8).load(torch.randn(16, 8))


def test_resolve_quantization() -> None:
    flags = cpu_flags()
    expected = "int8" if flags & {"avx2", "avx512_vnni", "avx_vnni", "asimddp", "i8mm"} else (
        "bf16" if flags & {"avx512_bf16", "amx_bf16", "bf16"} else "none")
    if not kernels.native_attention_available():
        expected = "none"  # quantized modes are batch-invariant only with the native attention kernel
    assert resolve_quantization("auto", "cpu") == expected
    # a GGUF file's own blocks where the VNNI panel kernel runs them (faster than int8 there)
    gguf_expected = "gguf" if expected != "none" and kernels.gguf_panels_available() else expected
    assert resolve_quantization("auto", "cpu", gguf_weights=True) == gguf_expected
    assert resolve_quantization("none", "cpu") == "none"
    assert resolve_quantization("auto", "cuda") == "none"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization("int8", "cuda")
    with pytest.raises(ValueError, match="quantization must be"):
        resolve_quantization("int4", "cpu")
    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(quantization="fp8")


@pytest.mark.skipif(not kernels.decoder_stack_available(), reason="no AVX2/AVX512-VNNI: the layers run one by one")
@pytest.mark.parametrize("mode", ["int8", "gguf"])
def test_decoder_stack_is_bit_identical_to_the_layer_by_layer_path(loaded_model, monkeypatch, mode) -> None:  # noqa: ANN001
    """One native call for every layer (kernels/decoder.c) gives the layers' own results: int8 projections, and
    the bundled file's Q4_1/Q8_0 blocks executed as stored (gguf)."""
    from tokenmill.model import llama

    ids = list(range(100, 180))
    fast = _runner(loaded_model, mode)
    logits = fast.prompt_logits(ids)
    assert fast.model._stack is not None, "the one-call decoder stack did not engage"
    if mode == "gguf":
        assert any(isinstance(m, GGUFLinear) and m.plan is not None for m in fast.model.modules())
    monkeypatch.setattr(llama.NativeDecoderStack, "supported", staticmethod(lambda model: False))
    slow = _runner(loaded_model, mode)
    assert torch.equal(slow.prompt_logits(ids), logits)
    assert slow.model._stack is None
