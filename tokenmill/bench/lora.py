"""Random LoRA adapters in PEFT's file layout, for benchmarks and checks that need adapters of a given shape
without training one (or installing peft)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tokenmill.config import ModelConfig
from tokenmill.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, part_shapes

MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
           "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def write_random_adapter(directory: Path, config: ModelConfig, rank: int, seed: int, b_scale: float = 0.1) -> None:
    """An adapter on every projection of every layer (alpha = rank): A ~ N(0, 1/in), B ~ N(0, b_scale^2 / rank),
    so that it changes a model's outputs without wrecking them."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for part, shape in part_shapes(config).items():
            name = f"base_model.model.model.layers.{layer}.{MODULES[part]}"
            a = torch.randn(rank, shape.in_features, generator=generator) * shape.in_features ** -0.5
            tensors[f"{name}.lora_A.weight"] = a
            tensors[f"{name}.lora_B.weight"] = torch.randn(shape.width, rank, generator=generator) * b_scale * \
                rank ** -0.5
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / WEIGHTS_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "bias": "none",
        "target_modules": [m.split(".")[1] for m in MODULES.values()]}))
