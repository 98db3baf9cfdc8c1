"""Rotary position embeddings: the inverse frequencies of every supported scaling, computed as transformers does
(`modeling_rope_utils`), so cos/sin tables are bit-identical to the reference's in float32.

A `RopeScaling` (model/rope_scaling.py) is plain data read from a Hugging Face config (`rope_scaling` /
`rope_parameters`) or from a GGUF's `rope.scaling.*` keys; `inverse_frequencies` turns it into (inv_freq,
attention_factor), and `RotaryEmbedding` into per-position tables.

Two scalings depend on the length of the sequence, not only on the position: `longrope` (Phi-3.5, Phi-4-mini)
switches to its long factors and `dynamic` (NTK) raises its base once a sequence outgrows the original context.
transformers decides per forward call from the call's largest position, so in a generation a token at position
p was rotated for the length max(prompt length, p + 1); `RotaryEmbedding` takes that length per token
(`rope_lengths`), which makes the choice per request and batch-invariant.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.model.rope_scaling import RopeScaling

RopeTables = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) [T, head_dim] of one step's positions


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling,
                        long: bool = False) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2], attention_factor): the factor multiplies cos and sin (yarn's and longrope's
    mscale). `head_dim` is the rotated width; `long` picks longrope's long factors. Dynamic NTK's frequencies
    within the original context are the default ones (`dynamic_inverse_frequencies` past it)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    kind = scaling.rope_type
    if scaling.freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32)
    if kind in ("default", "dynamic"):
        return inv_freq, 1.0
    if kind == "longrope":
        return _longrope(head_dim, theta, scaling, long)
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


def _longrope(head_dim: int, theta: float, scaling: RopeScaling, long: bool) -> tuple[torch.Tensor, float]:
    """LongRoPE: the base frequencies divided by per-frequency factors, a long set and a short one."""
    original = _require(scaling.original_max_position_embeddings, "original_max_position_embeddings", "longrope")
    factors = scaling.long_factor if long else scaling.short_factor
    if factors is None or len(factors) != head_dim // 2:
        raise ValueError(f"rope scaling 'longrope' needs long_factor and short_factor of {head_dim // 2} values")
    attention_factor = scaling.attention_factor
    if attention_factor is None:
        factor = scaling.factor
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents), float(attention_factor)


def dynamic_inverse_frequencies(head_dim: int, theta: float, factor: float, base_context: int,
                                lengths: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK: inv_freq [n, head_dim / 2] for sequences of `lengths` [n] past `base_context`, the base
    raised as transformers does (float32 tensor arithmetic, so the tables match its bits)."""
    lengths = torch.maximum(lengths, torch.tensor(base_context, dtype=lengths.dtype))
    base = theta * ((factor * lengths / base_context) - (factor - 1)) ** (head_dim / (head_dim - 2))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (base[:, None] ** exponents[None, :])


# Positions per block of a cos/sin table. Tables grow a block at a time as sequences reach them (Gemma 3's two
# tables for its 32k context would otherwise take 128 MB and 0.2 s at start-up); each block is computed by a call
# of the same shape, so a position's values never depend on how far the table had grown.
TABLE_BLOCK = 4096


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (Hugging Face layout) with a cos/sin table for every position reached so far (`reserve`).

    With `rotary_dim` < head_dim (partial rotary, Phi-4-mini) the loader has reordered each head's q/k rows so
    that the rotated dims form the outer parts of both halves ([rot_a, pass_a, rot_b, pass_b]); their table
    columns are cos 1, sin 0, so one full-width rotate-half kernel serves every model.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int, scaling: RopeScaling | None = None,
                 rotary_dim: int | None = None, base_context: int | None = None) -> None:
        super().__init__()
        self.scaling = scaling or RopeScaling()
        self.head_dim, self.theta = head_dim, theta
        self.rotary_dim = rotary_dim or head_dim
        self.max_positions = max_positions
        self.threshold = self.scaling.length_threshold(base_context or max_positions)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self._frequencies = [inverse_frequencies(self.rotary_dim, theta, self.scaling)]
        if self.scaling.rope_type == "longrope":
            self._frequencies.append(inverse_frequencies(self.rotary_dim, theta, self.scaling, long=True))
        cos, sin = self._table(*self._frequencies[0], 0, 0)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.long_tables: RopeTables | None = None if len(self._frequencies) == 1 else self._table(
            *self._frequencies[1], 0, 0)
        self.reserve(1)

    def reserve(self, num_positions: int) -> None:
        """Extend the tables, a whole block at a time, to cover the positions below `num_positions` (the tables
        stop growing at the model's context)."""
        have, wanted = self.cos.shape[0], min(num_positions, self.max_positions)
        if wanted <= have:
            return
        starts = range(have, -(-wanted // TABLE_BLOCK) * TABLE_BLOCK, TABLE_BLOCK)

        def extended(old: RopeTables, frequencies: tuple[torch.Tensor, float]) -> RopeTables:
            blocks = [self._table(*frequencies, start, TABLE_BLOCK) for start in starts]
            return (torch.cat([old[0], *(cos.to(old[0]) for cos, _ in blocks)]),
                    torch.cat([old[1], *(sin.to(old[1]) for _, sin in blocks)]))

        self.cos, self.sin = extended((self.cos, self.sin), self._frequencies[0])
        if self.long_tables is not None:
            self.long_tables = extended(self.long_tables, self._frequencies[1])

    def _table(self, inv_freq: torch.Tensor, attention_factor: float, first: int, num_positions: int) -> RopeTables:
        freqs = torch.arange(first, first + num_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        return self._layout(freqs, attention_factor)

    def _layout(self, freqs: torch.Tensor, attention_factor: float) -> RopeTables:
        """freqs [T, rotary_dim / 2] -> (cos, sin) [T, head_dim] in the rotate-half layout (module docstring)."""
        cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
        passed = (self.head_dim - self.rotary_dim) // 2
        if passed:
            cos = torch.cat((cos, torch.ones(len(freqs), passed)), dim=-1)
            sin = torch.cat((sin, torch.zeros(len(freqs), passed)), dim=-1)
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    def forward(self, positions: torch.Tensor, rope_lengths: torch.Tensor | None = None) -> RopeTables:
        """(cos, sin) [T, hd] of a step's positions: looked up once per step, shared by the layers using it.
        `rope_lengths` [T]: the sequence length each token is rotated for (module docstring); needed by the
        length-dependent scalings only."""
        cos, sin = self.cos[positions], self.sin[positions]
        if not self.scaling.length_dependent or rope_lengths is None:
            return cos, sin
        past = rope_lengths > self.threshold
        if not bool(past.any()):
            return cos, sin
        if self.long_tables is not None:
            long_cos, long_sin = self.long_tables
            rows = past[:, None]
            return torch.where(rows, long_cos[positions], cos), torch.where(rows, long_sin[positions], sin)
        # dynamic NTK: the base grows with the length, so these rows are computed for their own length
        index = past.nonzero().flatten()
        inv_freq = dynamic_inverse_frequencies(self.rotary_dim, self.theta, self.scaling.factor, self.threshold,
                                               rope_lengths[index])
        far_cos, far_sin = self._layout(positions[index].float()[:, None] * inv_freq, 1.0)
        cos, sin = cos.clone(), sin.clone()
        cos[index], sin[index] = far_cos, far_sin
        return cos, sin
