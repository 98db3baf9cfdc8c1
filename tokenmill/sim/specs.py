"""What the simulator knows of models and hardware: shapes from the models' configs, public peak numbers."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenmill.config import ModelConfig


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    gated_mlp: bool = True  # Llama's SwiGLU (3 matrices); OPT's MLP has 2
    tie_word_embeddings: bool = False

    @property
    def layer_params(self) -> int:
        """Weights of the linear layers of all decoder layers (attention projections and MLP)."""
        attention = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size
        return self.num_layers * (attention + mlp)

    @property
    def head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    @property
    def num_params(self) -> int:
        embeddings = 0 if self.tie_word_embeddings else self.head_params
        return self.layer_params + self.head_params + embeddings

    def kv_bytes_per_token(self, kv_bytes: float) -> float:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * kv_bytes


def spec_of(config: ModelConfig, name: str = "local") -> ModelSpec:
    """The simulator's view of a model the engine loaded."""
    return ModelSpec(name, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
                     config.head_dim, config.intermediate_size, config.vocab_size,
                     tie_word_embeddings=config.tie_word_embeddings)


# From each model's config.json (OPT: ffn_dim 4x, ReLU MLP, multi-head attention).
MODELS = {m.name: m for m in [
    ModelSpec("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, tie_word_embeddings=True),
    ModelSpec("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    ModelSpec("llama-2-13b", 40, 5120, 40, 40, 128, 13824, 32000),
    ModelSpec("opt-13b", 40, 5120, 40, 40, 128, 20480, 50272, gated_mlp=False),
    ModelSpec("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
]}


@dataclass(frozen=True)
class HardwareProfile:
    """One device (or this CPU). A step takes `step_overhead_s + per_sequence_s * sequences` plus its arithmetic
    and memory time: on GPUs the larger of the two (they overlap: a roofline), on a CPU calibrated with
    `combine="sum"` their sum."""

    name: str
    peak_flops: float  # dense 16-bit FLOP/s (int8 ops/s for an int8 CPU profile)
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    kv_read_efficiency: float | None = None  # of the bandwidth, reading the KV cache; None: bandwidth_efficiency
    step_overhead_s: float = 0.002
    per_sequence_s: float = 2e-5
    weight_bytes: float = 2.0  # bytes per weight as served (bf16: 2, int8: 1)
    kv_bytes: float = 2.0  # bytes per KV element
    combine: str = "max"  # "max": roofline; "sum": compute and memory do not overlap (fitted on a CPU)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> HardwareProfile:
        return cls(**json.loads(Path(path).read_text()))


# Public peak numbers: dense BF16 tensor-core FLOP/s and HBM bandwidth.
HARDWARE = {h.name: h for h in [
    HardwareProfile("a100-80gb", 312e12, 2.039e12, 80e9),
    HardwareProfile("h100-sxm", 989e12, 3.35e12, 80e9),
    HardwareProfile("h200", 989e12, 4.8e12, 141e9),
]}


def hardware(name_or_path: str) -> HardwareProfile:
    if name_or_path in HARDWARE:
        return HARDWARE[name_or_path]
    if Path(name_or_path).is_file():
        return HardwareProfile.load(name_or_path)
    raise ValueError(f"unknown hardware {name_or_path!r}: one of {sorted(HARDWARE)} or a profile JSON "
                     f"(tokenmill sim calibrate)")


def model(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: one of {sorted(MODELS)}")
    return MODELS[name]
