"""Per-channel key scales for 8-bit KV caches, derived from the weights.

Keys have outlier channels (Qwen2's K bias, QK-norm weights): a few channels hundreds of times larger than the
rest. With one scale per token and head (model/kv_quant.py) those channels set the scale and the others keep few
bits: on Qwen2.5-0.5B that alone costs int8 KV 1.7% of its teacher-forced top-1 agreement with bf16 KV.

An 8-bit cache therefore stores K / s and the queries are multiplied by s, a power of two per KV head and
channel: q.k is unchanged (multiplying by a power of two is exact in floating point), and K / s has channels of
alike size. s is the channel's expected size relative to the head's mean, rounded to a power of two, from the
weights alone: k = W (g * x) + b with x normalized (RMS 1), so E[k_c^2] ~ |W_c * g|^2 + b_c^2; after QK-norm,
k_c = n_c * k_c / rms(k). Channels c and c + head_dim / 2 rotate together under RoPE (rotate-half layout), so
they share the size of the pair (a rotation keeps it) and the same s. No data, no calibration: a replica and
its P/D peer loading the same file compute the same scales.
"""

from __future__ import annotations

import torch

MAX_EXPONENT = 8  # s within 2^-8 .. 2^8: beyond, the estimate is not trusted to that precision
# s = k_size^BALANCE / q_size^(1 - BALANCE): the integer attention (VNNI) quantizes queries per head to int8 too,
# so moving all of a channel's size into q would only move the loss there (measured: bench_fidelity
# --section kv-fidelity and tests/test_real_models.py's quality gate; 0.75 beat 0.5, 0.7, 0.8 and 1)
BALANCE = 0.75


def channel_sizes(weight: torch.Tensor, bias: torch.Tensor | None, input_norm: torch.Tensor,
                  qk_norm: torch.Tensor | None, heads: int, head_dim: int) -> torch.Tensor:
    """log2 of each rotary pair's expected size relative to its head's mean, [heads, head_dim / 2], for the
    projection weight [heads * head_dim, hidden] after the RMSNorm weight input_norm [hidden]."""
    scaled = weight.float() * input_norm.float()
    power = (scaled * scaled).sum(-1)
    if bias is not None:
        power = power + bias.float() ** 2
    size = power.view(heads, head_dim).sqrt()
    tiny = torch.finfo(torch.float32).tiny
    if qk_norm is not None:
        size = qk_norm.float().abs() * size / size.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(tiny)
    half = head_dim // 2
    pair = (size[:, :half] ** 2 + size[:, half:] ** 2).sqrt()
    return torch.log2((pair / pair.mean(-1, keepdim=True).clamp_min(tiny)).clamp_min(2.0 ** (-2 * MAX_EXPONENT)))


def key_channel_scales(k_sizes: torch.Tensor, q_sizes: torch.Tensor) -> torch.Tensor:
    """s [kv_heads, head_dim] float32, powers of two, from channel_sizes of the keys [kv_heads, head_dim / 2] and
    of the queries [heads, head_dim / 2] (a KV head's group of query heads averaged)."""
    kv_heads = k_sizes.shape[0]
    q_group = q_sizes.view(kv_heads, -1, q_sizes.shape[-1]).mean(1)
    exponent = (BALANCE * k_sizes - (1 - BALANCE) * q_group).round().clamp(-MAX_EXPONENT, MAX_EXPONENT)
    scales = torch.exp2(exponent)
    return torch.cat([scales, scales], -1).contiguous()
