"""The model families: what each one sets in `ModelConfig`, read from a Hugging Face `config.json` or from a
GGUF file's metadata, and how its GGUF tensors are named.

Each family is the Llama decoder with options (see `ModelConfig`); the constants transformers and llama.cpp
hard-code per family (Gemma 3's window pattern and local rope base, its attention scale) are written here once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.config import ModelConfig
from tokenmill.encoder.config import ENCODER_GGUF_ARCHITECTURES, ENCODER_HF_MODEL_TYPES
from tokenmill.model.rope_scaling import RopeScaling


@dataclass(frozen=True)
class Family:
    name: str
    hf_model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    qkv_bias: bool = False
    qk_norm: bool = False
    gemma: bool = False  # (1 + w) norms, sandwich norms, GeGLU, sqrt(hidden)-scaled embeddings
    gguf_rotary_permuted: bool = False  # llama.cpp interleaves the rotary halves of q/k rows (llama arch)
    fused_projections: bool = False  # checkpoints hold qkv_proj and gate_up_proj already fused (Phi-3)


FAMILIES = (
    Family("llama", ("llama",), ("llama",), gguf_rotary_permuted=True),
    Family("mistral", ("mistral",), ("mistral",), gguf_rotary_permuted=True),
    Family("qwen2", ("qwen2",), ("qwen2",), qkv_bias=True),
    Family("qwen3", ("qwen3",), ("qwen3",), qk_norm=True),
    Family("gemma3", ("gemma3_text",), ("gemma3",), qk_norm=True, gemma=True),
    Family("phi3", ("phi3",), ("phi3",), fused_projections=True),
)
SUPPORTED_HF_MODEL_TYPES = tuple(t for f in FAMILIES for t in f.hf_model_types)
SUPPORTED_GGUF_ARCHITECTURES = tuple(a for f in FAMILIES for a in f.gguf_architectures)

# Gemma 3: every 6th layer attends the whole context, the others a window, rotating with base 10,000 (both
# transformers' Gemma3TextConfig defaults and llama.cpp's hard-coded values; GGUF files carry neither).
GEMMA3_WINDOW_PATTERN = 6
# llama.cpp's token types (llama_token_type) as GGUF files store them
GGUF_NORMAL_TOKEN, GGUF_CONTROL_TOKEN, GGUF_USER_DEFINED_TOKEN = 1, 3, 4
GEMMA3_LOCAL_ROPE_THETA = 10000.0

# End-of-turn tokens that llama.cpp treats as end of generation wherever a vocabulary has them as control tokens
# (Llama 3's eot/eom, ChatML's im_end, Gemma's end_of_turn, Phi's end): a GGUF names only one eos id.
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "<|endoftext|>",
                      "<|end_of_text|>", "<EOT>")


def family_of_model_type(model_type: str) -> Family:
    for family in FAMILIES:
        if model_type in family.hf_model_types:
            return family
    if model_type in ENCODER_HF_MODEL_TYPES:  # served by the embedding engine, not as decoders
        raise ValueError(f"model_type {model_type!r} is an embedding model: serve it with --task embed "
                         "(LLM(task='embed'))")
    raise ValueError(f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_HF_MODEL_TYPES)})")


def family_of_architecture(arch: str) -> Family:
    for family in FAMILIES:
        if arch in family.gguf_architectures:
            return family
    if arch in ENCODER_GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is an embedding model: serve it with --task embed "
                         "(LLM(task='embed'))")
    raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})")


def _gemma3_sliding_layers(num_layers: int, pattern: int = GEMMA3_WINDOW_PATTERN) -> tuple[int, ...]:
    return tuple(i for i in range(num_layers) if (i + 1) % pattern)


def _gemma_options(hidden: int, query_pre_attn_scalar: float, final_softcap: float | None) -> dict[str, Any]:
    return {"sandwich_norm": True, "hidden_act": "gelu_tanh", "embed_scale": hidden**0.5,
            "attn_scale": query_pre_attn_scalar**-0.5, "final_logit_softcapping": final_softcap}


# ---------------------------------------------------------------- Hugging Face config.json


def _hf_rope(raw: dict[str, Any]) -> tuple[float, RopeScaling, float | None]:
    """(rope_theta, scaling of the full-attention layers, rope_theta of the windowed layers or None), from the
    older `rope_theta` / `rope_scaling` / `rope_local_base_freq` keys or transformers 5's `rope_parameters`
    (one dict, or one per layer type)."""
    max_positions = int(raw.get("max_position_embeddings", 2048))
    params = raw.get("rope_parameters")
    local_theta = raw.get("rope_local_base_freq")
    if isinstance(params, dict) and "full_attention" in params:
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"rope scaling on windowed layers is not supported: {local!r}")
        local_theta = local.get("rope_theta", local_theta)
        params = params["full_attention"]
    scaling_raw = raw.get("rope_scaling") or params
    theta = raw.get("rope_theta") or (params or {}).get("rope_theta") or 10000.0
    if isinstance(scaling_raw, dict) and raw.get("original_max_position_embeddings"):
        # Phi-3's configs keep the pre-training context at the top level
        scaling_raw = {"original_max_position_embeddings": raw["original_max_position_embeddings"]} | scaling_raw
    scaling = RopeScaling.from_hf(scaling_raw if isinstance(scaling_raw, dict) else None, max_positions)
    return float(theta), scaling, None if local_theta is None else float(local_theta)


def _hf_sliding_layers(raw: dict[str, Any], family: Family, num_layers: int) -> tuple[int, ...]:
    if raw.get("sliding_window") is None:
        return ()
    layer_types = raw.get("layer_types")
    if layer_types:
        return tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    if family.gemma:
        return _gemma3_sliding_layers(num_layers, int(raw.get("sliding_window_pattern") or GEMMA3_WINDOW_PATTERN))
    if family.name in ("qwen2", "qwen3"):  # windows only where the config turns them on, from a layer on
        if not raw.get("use_sliding_window"):
            return ()
        return tuple(range(int(raw.get("max_window_layers", 0)), num_layers))
    return tuple(range(num_layers))  # Mistral: every layer


def _eos_ids(*values: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            if item is not None and int(item) not in ids:
                ids.append(int(item))
    return tuple(ids)


def hf_model_config(raw: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
    """`config.json` (and `generation_config.json`, whose eos list wins additions) -> ModelConfig."""
    if raw.get("model_type") == "gemma3" and "text_config" in raw:
        raise ValueError("Gemma 3 multimodal checkpoints (Gemma3ForConditionalGeneration) are not supported: "
                         "give a text-only one (model_type gemma3_text)")
    family = family_of_model_type(str(raw.get("model_type", "llama")))
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    num_layers = int(raw["num_hidden_layers"])
    head_dim = int(raw.get("head_dim") or hidden // heads)
    params = raw.get("rope_parameters")
    rotary_factor = float(raw.get("partial_rotary_factor")
                          or (params.get("partial_rotary_factor") if isinstance(params, dict) else None) or 1.0)
    theta, scaling, local_theta = _hf_rope(raw)
    sliding = _hf_sliding_layers(raw, family, num_layers)
    options: dict[str, Any] = {}
    if family.gemma:
        if raw.get("attn_logit_softcapping") is not None:
            raise ValueError("attention logit soft-capping (Gemma 2) is not supported")
        options = _gemma_options(hidden, float(raw.get("query_pre_attn_scalar") or head_dim),
                                 raw.get("final_logit_softcapping"))
        local_theta = local_theta if local_theta is not None else GEMMA3_LOCAL_ROPE_THETA
    activation = raw.get("hidden_act") or raw.get("hidden_activation") or "silu"
    if activation not in ("silu", "gelu_pytorch_tanh"):
        raise ValueError(f"activation {activation!r} is not supported (silu, gelu_pytorch_tanh)")
    bos = raw.get("bos_token_id")
    return ModelConfig(
        architecture=family.name,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", family.gemma)),
        qkv_bias=family.qkv_bias or bool(raw.get("attention_bias", False)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_eos_ids(raw.get("eos_token_id"), (generation_config or {}).get("eos_token_id")),
        rope_scaling=scaling,
        qk_norm=family.qk_norm,
        sliding_window=int(raw["sliding_window"]) if sliding else None,
        sliding_layers=sliding,
        rope_local_theta=local_theta if sliding else None,
        rotary_dim=int(head_dim * rotary_factor) if rotary_factor != 1.0 else None,
        **options,
    )


def read_hf_config(path: str) -> tuple[ModelConfig, Family]:
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    generation: dict[str, Any] | None = None
    generation_path = os.path.join(path, "generation_config.json")
    if os.path.exists(generation_path):
        with open(generation_path) as f:
            generation = json.load(f)
    config = hf_model_config(raw, generation)
    return config, family_of_model_type(str(raw.get("model_type", "llama")))


# ---------------------------------------------------------------- GGUF


def gguf_model_config(field: Callable[[str, Any], Any], tensor_names: set[str], vocab_tokens: Sequence[str],
                      token_types: list[int], config_tensors: dict[str, tuple[float, ...]]
                      ) -> tuple[ModelConfig, Family]:
    """`field(key, default)` reads GGUF metadata, `config_tensors` the GGUF_CONFIG_TENSORS the file has;
    llama.cpp's conventions fill what a GGUF does not say."""
    arch = str(field("general.architecture", None))
    family = family_of_architecture(arch)

    def get(key: str, default: Any = None) -> Any:
        return field(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    num_layers = int(get("block_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    theta = float(get("rope.freq_base", 10000.0))
    kind = str(get("rope.scaling.type", "none"))
    rotary_dim = int(get("rope.dimension_count", head_dim))
    freq_factors = config_tensors.get("rope_freqs.weight")
    scaling = RopeScaling(freq_factors=freq_factors)
    if "rope_factors_long.weight" in config_tensors:  # Phi-3.5/Phi-4-mini: longrope's factors as tensors
        original = get("rope.scaling.original_context_length")
        attn_factor = get("rope.scaling.attn_factor")
        scaling = RopeScaling(rope_type="longrope", factor=int(get("context_length", 2048)) / int(original),
                              original_max_position_embeddings=int(original),
                              attention_factor=None if attn_factor is None else float(attn_factor),
                              long_factor=config_tensors["rope_factors_long.weight"],
                              short_factor=config_tensors["rope_factors_short.weight"])
    elif kind in ("linear", "yarn"):
        original = get("rope.scaling.original_context_length")
        scaling = RopeScaling(rope_type=kind, factor=float(get("rope.scaling.factor", 1.0)),
                              original_max_position_embeddings=None if original is None else int(original),
                              freq_factors=freq_factors)
    elif kind not in ("none", "None"):
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported (linear, yarn, llama3 via rope_freqs)")
    options: dict[str, Any] = {}
    sliding: tuple[int, ...] = ()
    window = get("attention.sliding_window")
    if family.gemma:
        # llama.cpp: Gemma 3 27B scales queries by hidden/heads, the other sizes by head_dim (query_pre_attn_scalar)
        scalar = hidden / heads if num_layers == 62 else head_dim
        options = _gemma_options(hidden, float(scalar), get("final_logit_softcapping"))
        if window:
            sliding = _gemma3_sliding_layers(num_layers, int(get("attention.sliding_window_pattern",
                                                                 GEMMA3_WINDOW_PATTERN)))
    eos = field("tokenizer.ggml.eos_token_id", None)
    extra_eos = [field(f"tokenizer.ggml.{key}_token_id", None) for key in ("eot", "eom")]
    turn_ends = [i for i, kind_id in enumerate(token_types)
                 if kind_id == GGUF_CONTROL_TOKEN and vocab_tokens[i] in END_OF_TURN_TOKENS]
    bos = field("tokenizer.ggml.bos_token_id", None)
    config = ModelConfig(
        architecture=family.name,
        vocab_size=int(get("vocab_size", len(vocab_tokens))),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_eos_ids(eos, *extra_eos, turn_ends),
        rope_scaling=scaling,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        sliding_window=int(window) if sliding else None,
        sliding_layers=sliding,
        rope_local_theta=GEMMA3_LOCAL_ROPE_THETA if sliding else None,
        rotary_dim=rotary_dim if rotary_dim != head_dim else None,
        **options,
    )
    return config, family


# GGUF tensor name suffix -> HF name suffix, per layer. `ffn_norm` is the norm in front of the MLP: Llama's
# post_attention_layernorm, Gemma's pre_feedforward_layernorm (Gemma's post_attention_layernorm is the norm on
# the attention output, `post_attention_norm` in GGUF).
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GEMMA_LAYER_NAMES = _GGUF_LAYER_NAMES | {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Phi-3 files fuse q/k/v (attn_qkv) and gate/up (ffn_up holds both halves)
_GGUF_PHI3_LAYER_NAMES = _GGUF_LAYER_NAMES | {
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# tensors that configure the model rather than weigh it (read by the loader into ModelConfig)
GGUF_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def hf_tensor_name(gguf_name: str, family: Family) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    names = (_GGUF_GEMMA_LAYER_NAMES if family.gemma else
             _GGUF_PHI3_LAYER_NAMES if family.fused_projections else _GGUF_LAYER_NAMES)
    prefix, layer, rest = gguf_name.split(".", 2)
    if prefix != "blk" or rest not in names:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for architecture {family.name!r}")
    return f"model.layers.{layer}.{names[rest]}"
