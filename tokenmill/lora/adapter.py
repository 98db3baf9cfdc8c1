"""A PEFT LoRA checkpoint (`adapter_config.json` + `adapter_model.safetensors`) read into the engine's layout.

The engine fuses q/k/v and gate/up into one projection each (model/llama.py), so an adapter's modules become
*parts* of those projections: a column range of the fused output with its own A and B. A part's weights are
kept as A [rank, in] and Bt = (scale * B).T [rank, width], the layout the kernel streams (kernels/lora.c).
What the engine cannot run exactly as PEFT does is refused with the reason (DoRA, modules_to_save, embedding
or LM-head targets, LoRA biases)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.config import ModelConfig
from tokenmill.lora.request import LoRAError, LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# the parts of the engine's projections, in the order the projections run
PART_NAMES = ("q", "k", "v", "o", "gate", "up", "down")
# a PEFT module -> the parts it covers (Phi-3 checkpoints store q/k/v and gate/up fused)
MODULE_PARTS = {"q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "o_proj": ("o",), "qkv_proj": ("q", "k", "v"),
                "gate_proj": ("gate",), "up_proj": ("up",), "gate_up_proj": ("gate", "up"), "down_proj": ("down",)}
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class PartShape:
    projection: str  # "qkv", "o", "gate_up" or "down"
    in_features: int
    offset: int  # first column of the fused projection's output
    width: int


def part_shapes(config: ModelConfig) -> dict[str, PartShape]:
    q, kv, hidden, inter = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, \
        config.hidden_size, config.intermediate_size
    return {"q": PartShape("qkv", hidden, 0, q), "k": PartShape("qkv", hidden, q, kv),
            "v": PartShape("qkv", hidden, q + kv, kv), "o": PartShape("o", q, 0, hidden),
            "gate": PartShape("gate_up", hidden, 0, inter), "up": PartShape("gate_up", hidden, inter, inter),
            "down": PartShape("down", inter, 0, hidden)}


@dataclass
class LoRAAdapter:
    request: LoRARequest
    rank: int  # the largest rank of its modules
    # (layer, part) -> (A [rank, in], Bt [rank, width]) in float32, the scale folded into Bt
    parts: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.parts.values())


def read_adapter_config(path: str | Path) -> dict[str, Any]:
    """The adapter's config, checked for what the engine supports (LoRAError otherwise)."""
    directory = Path(path)
    config_file = directory / CONFIG_FILE
    if not config_file.is_file():
        raise LoRAError(f"no {CONFIG_FILE} in {directory}: not a PEFT adapter directory")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LoRAError(f"cannot read {config_file}: {exc}") from exc
    if not isinstance(config, dict):
        raise LoRAError(f"{config_file} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"only LoRA adapters are supported, this one is {config.get('peft_type')}")
    refusals = {
        "use_dora": "DoRA adapters are not supported",
        "modules_to_save": "adapters with modules_to_save (fully trained extra layers) are not supported",
        "lora_bias": "LoRA biases are not supported",
        "target_parameters": "adapters on parameters (target_parameters) are not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D) adapters are not supported",
    }
    for key, reason in refusals.items():
        if config.get(key):
            raise LoRAError(reason)
    if config.get("bias", "none") != "none":
        raise LoRAError(f"adapters that train biases (bias={config['bias']!r}) are not supported")
    if not (directory / WEIGHTS_FILE).is_file():
        raise LoRAError(f"no {WEIGHTS_FILE} in {directory} (only safetensors checkpoints are read)")
    return config


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the module name's tail."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def load_adapter(request: LoRARequest, model: ModelConfig, max_rank: int,
                 rotary_order: torch.Tensor | None = None) -> LoRAAdapter:
    """Read and convert an adapter for `model`. `rotary_order`: the fused q/k/v row order the model was loaded
    with (partial rotary), applied to the adapter's q and k columns alike."""
    from safetensors.torch import load_file

    config = read_adapter_config(request.lora_path)
    tensors = load_file(str(Path(request.lora_path) / WEIGHTS_FILE))
    pairs: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.match(name)
        if match is None:
            if "embed" in name or "lm_head" in name:
                raise LoRAError(f"embedding and LM-head targets are not supported ({name})")
            if "magnitude" in name:
                raise LoRAError("DoRA adapters are not supported")
            raise LoRAError(f"unsupported tensor in the adapter: {name}")
        module, layer, kind, which = match.group(1), int(match.group(2)), match.group(3), match.group(4)
        if kind not in MODULE_PARTS:
            raise LoRAError(f"unsupported LoRA target module {kind!r} ({name})")
        if layer >= model.num_layers:
            raise LoRAError(f"the adapter targets layer {layer}; the model has {model.num_layers}")
        pairs.setdefault((layer, kind, module), {})[which] = tensor
    if not pairs:
        raise LoRAError(f"{request.lora_path} holds no LoRA weights")
    shapes = part_shapes(model)
    alpha_default = float(config.get("lora_alpha", config.get("r", 8)))
    alpha_pattern = config.get("alpha_pattern") or {}
    parts: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    top_rank = 0
    for (layer, kind, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"{module}: lora_A and lora_B must both be present")
        a, b = pair["A"].float(), pair["B"].float()
        rank = a.shape[0]
        names = MODULE_PARTS[kind]
        in_features = shapes[names[0]].in_features
        width = sum(shapes[n].width for n in names)
        if a.dim() != 2 or a.shape[1] != in_features or tuple(b.shape) != (width, rank):
            raise LoRAError(f"{module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the model "
                            f"(expected [r, {in_features}] and [{width}, r]): an adapter for another base model?")
        if rank > max_rank:
            raise LoRAError(f"{module}: rank {rank} exceeds --max-lora-rank {max_rank}")
        alpha = float(_pattern_value(alpha_pattern, module, alpha_default))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        first = 0
        for part in names:
            shape = shapes[part]
            rows = b[first:first + shape.width]
            first += shape.width
            if rotary_order is not None and part in ("q", "k"):
                local = rotary_order[shape.offset:shape.offset + shape.width] - shape.offset
                rows = rows[local]
            parts[(layer, part)] = (a.contiguous(), (rows * scale).t().contiguous())
        top_rank = max(top_rank, rank)
    return LoRAAdapter(request, top_rank, parts)
