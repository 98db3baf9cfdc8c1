"""The int8 cache's key channel scales (model/key_smoothing.py): where they come from and what they buy."""

from __future__ import annotations

import torch

from tokenmill.model import kv_quant
from tokenmill.model.key_smoothing import MAX_EXPONENT, channel_sizes, key_channel_scales

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 8, 2, 64, 256
HALF = HEAD_DIM // 2


def _projections(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q_weight = torch.randn(HEADS * HEAD_DIM, HIDDEN, generator=gen) * 0.05
    k_weight = torch.randn(KV_HEADS * HEAD_DIM, HIDDEN, generator=gen) * 0.05
    k_bias = torch.randn(KV_HEADS * HEAD_DIM, generator=gen) * 0.1
    norm = 0.5 + torch.rand(HIDDEN, generator=gen)
    return q_weight, k_weight, k_bias, norm


def _scales(q_weight: torch.Tensor, k_weight: torch.Tensor, k_bias: torch.Tensor | None, norm: torch.Tensor,
            k_norm: torch.Tensor | None = None) -> torch.Tensor:
    return key_channel_scales(channel_sizes(k_weight, k_bias, norm, k_norm, KV_HEADS, HEAD_DIM),
                              channel_sizes(q_weight, None, norm, None, HEADS, HEAD_DIM))


def test_scales_are_powers_of_two_shared_by_rotary_pairs_and_large_on_outlier_channels() -> None:
    q_weight, k_weight, k_bias, norm = _projections(0)
    k_bias[HEAD_DIM + 5] = 40.0  # Qwen2-like: one key channel of KV head 1 far above the rest
    scales = _scales(q_weight, k_weight, k_bias, norm)
    assert scales.shape == (KV_HEADS, HEAD_DIM) and scales.dtype == torch.float32
    exponent = torch.log2(scales)
    assert torch.equal(exponent, exponent.round()) and exponent.abs().max() <= MAX_EXPONENT
    assert torch.equal(scales[:, :HALF], scales[:, HALF:])  # RoPE rotates c with c + head_dim / 2
    assert scales[1, 5] >= 8 and scales[1, HALF + 5] >= 8
    assert scales[0].max() <= 2 and scales[1, 6:HALF].max() <= 2  # the ordinary channels stay near 1

    # after QK-norm (Gemma 3, Qwen3) the norm's weight sets the channels' sizes
    k_norm = torch.ones(HEAD_DIM)
    k_norm[HALF + 9] = 64.0
    normed = _scales(q_weight, k_weight, None, norm, k_norm)
    assert normed[0, 9] >= 8 and normed[1, 9] >= 8 and normed[:, 10:HALF].max() <= 2


def test_queries_times_the_scales_dot_keys_over_them_is_exactly_q_dot_k() -> None:
    q_weight, k_weight, k_bias, norm = _projections(1)
    k_bias[7] = 25.0
    scales = _scales(q_weight, k_weight, k_bias, norm)
    cache = kv_quant.LayerKV(torch.empty(0), torch.empty(0), key_channel_scale=scales)
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(5, HEADS, HEAD_DIM, generator=gen), torch.randn(5, KV_HEADS, HEAD_DIM, generator=gen) * 30
    q_s, k_s = kv_quant.smooth_keys(q, k, cache)
    group = HEADS // KV_HEADS
    # products of powers of two are exact: every term, hence every score, is the same float
    assert torch.equal(q_s * k_s.repeat_interleave(group, 1), q * k.repeat_interleave(group, 1))


def test_the_scales_shrink_int8_score_error_where_keys_have_outlier_channels() -> None:
    """Keys with one channel 100x the rest (a bias): per-token int8 quantization loses the other channels unless
    the keys are divided by the channel scales first. Score error against float, with and without."""
    q_weight, k_weight, k_bias, norm = _projections(3)
    k_bias[3] = k_bias[HALF + 3] = 30.0
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(256, HIDDEN, generator=gen)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt() * norm  # what the projections see: RMS-normed inputs
    q = (x @ q_weight.T).view(-1, HEADS, HEAD_DIM)[:, :HEADS // KV_HEADS]  # KV head 0's queries
    k = (x @ k_weight.T + k_bias).view(-1, KV_HEADS, HEAD_DIM)[:, :1]
    exact = torch.einsum("ahd,bhd->ahb", q.double(), k.double().expand(-1, q.shape[1], -1))
    int8 = kv_quant.kv_format("int8")
    errors = []
    for scales in (torch.ones(1, HEAD_DIM), _scales(q_weight, k_weight, k_bias, norm)[:1]):
        values, token_scales = kv_quant.quantize(k / scales, int8)
        stored = kv_quant.dequantize(values, token_scales[..., None])
        scores = torch.einsum("ahd,bhd->ahb", (q * scales).double(), stored.double().expand(-1, q.shape[1], -1))
        errors.append(float((scores - exact).abs().mean() / exact.abs().mean()))
    plain, smoothed = errors
    assert smoothed * 3 < plain, errors  # measured 4.9x
