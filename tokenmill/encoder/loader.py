"""Loading an encoder (its front: config, pooling, tokenizer; and its weights) and building its engine core: an
EngineCore over an EncoderRunner, for an engine-core process, the API process's engine thread or the offline
EmbeddingEngine alike."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from tokenmill.config import EngineConfig
from tokenmill.encoder.front import EncoderFront, encoder_core_config, read_encoder_front
from tokenmill.encoder.model import EncoderModel
from tokenmill.encoder.runner import EncoderRunner
from tokenmill.encoder.weights import load_encoder_weights
from tokenmill.engine.core import EngineCore
from tokenmill.model.gguf_file import GGUFFile
from tokenmill.model.metadata import resolve_model_path
from tokenmill.platform import cpu_flags

logger = logging.getLogger(__name__)


@dataclass
class LoadedEncoder:
    front: EncoderFront
    model: EncoderModel
    quantization: str  # the linear layers' resolved mode


def load_encoder(config: EngineConfig) -> LoadedEncoder:
    started = time.perf_counter()
    path = resolve_model_path(config.model)
    reader = None if os.path.isdir(path) else GGUFFile(path)  # one header read for config, vocabulary, tensors
    front = read_encoder_front(config, reader)
    quantization = resolve_encoder_quantization(config.quantization)
    model = EncoderModel(front.config, quantization)
    model.load_weights(load_encoder_weights(path, reader))
    model_config = front.config
    logger.info("encoder %s (%s, %d layers, hidden %d): pooling %s%s, %s linears, max %d tokens an input; "
                "loaded in %.1f s", path, model_config.architecture, model_config.num_layers,
                model_config.hidden_size, front.pooling, ", normalized" if front.normalize else "", quantization,
                front.max_model_len, time.perf_counter() - started)
    return LoadedEncoder(front, model, quantization)


def encoder_core(config: EngineConfig, loaded: LoadedEncoder | None = None) -> EngineCore:
    """The engine core of an encoder: its Scheduler admits each input whole (encoder_core_config) and the
    EncoderRunner computes a step's inputs in one forward."""
    front, runner, core_config = encoder_core_parts(config, loaded)
    return EngineCore(core_config, runner, front.max_model_len)


def encoder_core_parts(config: EngineConfig, loaded: LoadedEncoder | None = None
                       ) -> tuple[EncoderFront, EncoderRunner, EngineConfig]:
    """(the encoder's front, its runner, the config its core runs under)."""
    loaded = loaded or load_encoder(config)
    max_model_len = loaded.front.max_model_len
    runner = EncoderRunner(loaded.model, loaded.front.pooling, config.max_num_seqs, max_model_len,
                           config.block_size)
    return loaded.front, runner, encoder_core_config(config, max_model_len)


def resolve_encoder_quantization(mode: str) -> str:
    """The encoder's linear layers. "auto": bf16 where the CPU computes in bf16 (measured on nomic-embed-text
    against llama.cpp's f16: cosine >= 0.99996, 2.1x float32's speed on a batch of 64), else float32; int8 rows
    lose too much for embeddings (cosine 0.996) and are taken only when asked for."""
    if mode == "auto":
        return "bf16" if cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"} else "none"
    if mode not in ("none", "bf16", "int8"):
        raise ValueError(f"an encoder's quantization is auto, none, bf16 or int8, got {mode!r}")
    return mode
