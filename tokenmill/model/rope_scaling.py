"""A model's rope scaling as plain data (Hugging Face `rope_scaling` / `rope_parameters`, GGUF `rope.scaling.*`).

No torch here: the engine's configuration (config.py) holds one, and `tokenmill serve`'s front end reads the
configuration without importing torch. model/rope.py turns it into frequencies and tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")


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
    long_factor: tuple[float, ...] | None = None  # longrope: per-frequency divisors past the original context
    short_factor: tuple[float, ...] | None = None  # ... and within it

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
        if rope_type == "su":  # Phi-3's first name for longrope
            rope_type = "longrope"
        if rope_type == "default":
            return RopeScaling()

        def number(key: str) -> float | None:
            value = raw.get(key)
            return None if value is None else float(value)

        original = raw.get("original_max_position_embeddings")
        factor = number("factor")
        if rope_type in ("yarn", "longrope") and factor is None and original:
            factor = max_position_embeddings / int(original)

        def factors(key: str) -> tuple[float, ...] | None:
            value = raw.get(key)
            return None if value is None else tuple(float(v) for v in value)

        return RopeScaling(
            rope_type=rope_type, factor=1.0 if factor is None else factor,
            original_max_position_embeddings=None if original is None else int(original),
            low_freq_factor=number("low_freq_factor"), high_freq_factor=number("high_freq_factor"),
            beta_fast=number("beta_fast"), beta_slow=number("beta_slow"),
            attention_factor=number("attention_factor"), mscale=number("mscale"),
            mscale_all_dim=number("mscale_all_dim"), truncate=bool(raw.get("truncate", True)),
            long_factor=factors("long_factor"), short_factor=factors("short_factor"),
        )

    @property
    def length_dependent(self) -> bool:
        return self.rope_type in LENGTH_DEPENDENT_ROPE_TYPES

    def length_threshold(self, max_position_embeddings: int) -> int:
        """The sequence length past which a length-dependent scaling changes its frequencies: longrope's
        original context, dynamic NTK's trained one (max_position_embeddings)."""
        if self.rope_type == "longrope":
            return self.original_max_position_embeddings or max_position_embeddings
        return max_position_embeddings

    def context_length(self, max_position_embeddings: int) -> int:
        """The longest sequence the scaling serves: dynamic NTK extends the model's context by its factor."""
        if self.rope_type == "dynamic" and self.factor > 1:
            return int(max_position_embeddings * self.factor)
        return max_position_embeddings
