"""Rotary position embeddings: the inverse frequencies of every supported scaling, computed as transformers does
(`modeling_rope_utils`), so cos/sin tables are bit-identical to the reference's in float32.

A `RopeScaling` is plain data read from a Hugging Face config (`rope_scaling` / `rope_parameters`) or from a
GGUF's `rope.scaling.*` keys; `inverse_frequencies` turns it into (inv_freq, attention_factor), and
`RotaryEmbedding` into per-position tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

RopeTables = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) [T, head_dim] of one step's positions

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # per-frequency divisors stored in a GGUF (llama.cpp's `rope_freqs.weight`: Llama 3's scaling, precomputed)
    freq_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope scaling type {self.rope_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")

    @staticmethod
    def from_hf(raw: dict[str, Any] | None, max_position_embeddings: int) -> RopeScaling:
        """From a config's `rope_scaling` (or transformers 5's `rope_parameters`) dict; None: no scaling."""
        if not raw:
            return RopeScaling()
        rope_type = str(raw.get("rope_type", raw.get("type", "default")) or "default")
        if rope_type == "default":
            return RopeScaling()

        def number(key: str) -> float | None:
            value = raw.get(key)
            return None if value is None else float(value)

        original = raw.get("original_max_position_embeddings")
        factor = number("factor")
        if rope_type == "yarn" and factor is None and original:
            factor = max_position_embeddings / int(original)
        return RopeScaling(
            rope_type=rope_type, factor=1.0 if factor is None else factor,
            original_max_position_embeddings=None if original is None else int(original),
            low_freq_factor=number("low_freq_factor"), high_freq_factor=number("high_freq_factor"),
            beta_fast=number("beta_fast"), beta_slow=number("beta_slow"),
            attention_factor=number("attention_factor"), mscale=number("mscale"),
            mscale_all_dim=number("mscale_all_dim"), truncate=bool(raw.get("truncate", True)),
        )


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2], attention_factor): the factor multiplies cos and sin (yarn's mscale)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    kind = scaling.rope_type
    if scaling.freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32)
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    return _yarn(head_dim, theta, scaling)


def _require(value: float | int | None, name: str, kind: str) -> float:
    if value is None:
        raise ValueError(f"rope scaling {kind!r} needs {name!r}")
    return float(value)


def _llama3(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    factor = scaling.factor
    low = _require(scaling.low_freq_factor, "low_freq_factor", "llama3")
    high = _require(scaling.high_freq_factor, "high_freq_factor", "llama3")
    old_context = _require(scaling.original_max_position_embeddings, "original_max_position_embeddings", "llama3")
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn(head_dim: int, theta: float, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated frequencies below a correction range, extrapolated above it, a linear ramp within."""
    factor = scaling.factor
    original = _require(scaling.original_max_position_embeddings, "original_max_position_embeddings", "yarn")

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    attention_factor = scaling.attention_factor
    if attention_factor is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention_factor = mscale(factor, scaling.mscale) / mscale(factor, scaling.mscale_all_dim)
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = scaling.beta_fast or 32, scaling.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (Hugging Face layout) with a cos/sin table for every position."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        inv_freq, attention_factor = inverse_frequencies(head_dim, theta, scaling or RopeScaling())
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_factor, persistent=False)

    def forward(self, positions: torch.Tensor) -> RopeTables:
        """(cos, sin) [T, hd] of a step's positions: looked up once per step, shared by the layers using it."""
        return self.cos[positions], self.sin[positions]
