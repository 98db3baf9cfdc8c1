"""What an encoder model file says about itself: `EncoderConfig`, read from a Hugging Face directory
(`config.json`, sentence-transformers' pooling files) or a GGUF file's metadata (llama.cpp's `bert` and
`nomic-bert` architectures).

Two families: BERT (learned absolute positions, biases, GELU, pooler + classifier for cross-encoders) and
nomic-bert (rotary positions, no biases, SwiGLU). Both are post-norm encoders with token-type embeddings.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenmill.model.gguf_file import GGUFFile

Pooling = Literal["mean", "cls", "last"]
POOLING_TYPES: tuple[Pooling, ...] = ("mean", "cls", "last")
# llama.cpp's llama_pooling_type as GGUF files store it ({arch}.pooling_type)
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last", 4: "cls"}  # 4: rank (a classifier over the CLS state)
ENCODER_HF_MODEL_TYPES = ("bert", "nomic_bert")
ENCODER_GGUF_ARCHITECTURES = ("bert", "nomic-bert")


@dataclass(frozen=True)
class EncoderConfig:
    architecture: Literal["bert", "nomic-bert"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    layer_norm_eps: float
    type_vocab_size: int = 2
    rope_theta: float | None = None  # rotary positions (nomic-bert); None: learned absolute positions
    pooling: Pooling = "cls"
    normalize: bool = True  # embeddings leave L2-normalised (sentence-transformers' Normalize module)
    num_labels: int = 0  # a classification head over the pooled state (a cross-encoder reranker) when > 0
    matryoshka_dimensions: tuple[int, ...] | None = field(default=None)  # truncations the model was trained for
    pad_token_id: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def gated_mlp(self) -> bool:
        return self.architecture == "nomic-bert"

    @property
    def is_cross_encoder(self) -> bool:
        return self.num_labels > 0


def _sentence_transformers_pooling(path: str) -> tuple[Pooling | None, bool | None]:
    """(pooling, normalize) from sentence-transformers' modules.json and its Pooling module's config."""
    modules_path = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_path):
        return None, None
    with open(modules_path) as f:
        modules = json.load(f)
    pooling: Pooling | None = None
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    for module in modules:
        if str(module.get("type", "")).endswith("Pooling"):
            with open(os.path.join(path, module.get("path", ""), "config.json")) as f:
                raw = json.load(f)
            if raw.get("pooling_mode_cls_token"):
                pooling = "cls"
            elif raw.get("pooling_mode_lasttoken"):
                pooling = "last"
            elif raw.get("pooling_mode_mean_tokens"):
                pooling = "mean"
    return pooling, normalize


def hf_encoder_config(path: str) -> EncoderConfig:
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    model_type = raw.get("model_type")
    if model_type not in ENCODER_HF_MODEL_TYPES:
        raise ValueError(f"unsupported encoder model_type {model_type!r} (supported: "
                         f"{', '.join(ENCODER_HF_MODEL_TYPES)})")
    nomic = model_type == "nomic_bert"
    architectures = raw.get("architectures") or []
    cross_encoder = any(a.endswith("ForSequenceClassification") for a in architectures)
    activation = raw.get("hidden_act", "silu" if nomic else "gelu")
    if activation != ("silu" if nomic else "gelu"):
        raise ValueError(f"{model_type} with hidden_act {activation!r} is not supported")
    if not nomic and raw.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError("BERT with relative position embeddings is not supported")
    pooling, normalize = _sentence_transformers_pooling(path)
    rope = raw.get("rope_parameters") or {}
    matryoshka = raw.get("matryoshka_dimensions")
    return EncoderConfig(
        architecture="nomic-bert" if nomic else "bert",
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=int(raw["num_attention_heads"]),
        max_position_embeddings=int(raw.get("max_position_embeddings", 512)),
        layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
        type_vocab_size=int(raw.get("type_vocab_size", 2)),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 1000.0))) if nomic else None,
        pooling=pooling or ("cls" if cross_encoder or not nomic else "mean"),
        normalize=not cross_encoder if normalize is None else normalize,
        num_labels=int(raw.get("num_labels", len(raw.get("id2label") or {}) or 1)) if cross_encoder else 0,
        matryoshka_dimensions=(tuple(int(d) for d in matryoshka) if matryoshka
                               else (int(raw["hidden_size"]),) if raw.get("is_matryoshka") else None),
        pad_token_id=int(raw.get("pad_token_id") or 0),
    )


def gguf_encoder_config(reader: GGUFFile) -> EncoderConfig:
    arch = str(reader.fields.get("general.architecture"))
    if arch not in ENCODER_GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported encoder architecture {arch!r} (supported: "
                         f"{', '.join(ENCODER_GGUF_ARCHITECTURES)})")

    def get(key: str, default: Any = None) -> Any:
        return reader.fields.get(f"{arch}.{key}", default)

    if get("attention.causal", False):
        raise ValueError(f"this {arch} file is causal: not an encoder")
    tensors = {t.name: t for t in reader.tensors}
    pooling_id = int(get("pooling_type", 2))
    if pooling_id not in GGUF_POOLING:
        raise ValueError(f"GGUF pooling type {pooling_id} is not supported (mean, cls, last, rank)")
    cross_encoder = "cls.output.weight" in tensors
    tokens = reader.fields.get("tokenizer.ggml.tokens", [])
    return EncoderConfig(
        architecture="nomic-bert" if arch == "nomic-bert" else "bert",
        vocab_size=int(get("vocab_size", len(tokens))),
        hidden_size=int(get("embedding_length")),
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=int(get("attention.head_count")),
        max_position_embeddings=int(get("context_length", 512)),
        layer_norm_eps=float(get("attention.layer_norm_epsilon", 1e-12)),
        type_vocab_size=int(reader.fields.get("tokenizer.ggml.token_type_count", 2)),
        rope_theta=float(get("rope.freq_base", 1000.0)) if arch == "nomic-bert" else None,
        pooling=GGUF_POOLING[pooling_id],  # type: ignore[arg-type]
        normalize=not cross_encoder,
        # cls.output.weight is [labels, hidden] (GGUF lists the inner dimension first)
        num_labels=(int(tensors["cls.output.weight"].shape[1]) if len(tensors["cls.output.weight"].shape) > 1
                    else 1) if cross_encoder else 0,
        pad_token_id=int(reader.fields.get("tokenizer.ggml.padding_token_id", 0)),
    )


def read_encoder_config(path: str, reader: GGUFFile | None = None) -> EncoderConfig:
    """`reader`: the GGUF at `path` already opened (its header is read once per load)."""
    if os.path.isdir(path):
        return hf_encoder_config(path)
    return gguf_encoder_config(reader or GGUFFile(path))


def embedding_kind(path: str) -> Literal["encoder", "decoder"] | None:
    """What embeds at `path`, from one read of its header: "encoder" (an encoder this package serves),
    "decoder" (a decoder its file marks as an embedding model: a GGUF with last-token pooling, as llama.cpp
    converts Qwen3-Embedding, or an HF directory whose sentence-transformers pooling takes the last token), or
    None (a generative model)."""
    if os.path.isdir(path):
        config_path = os.path.join(path, "config.json")
        if os.path.isfile(config_path):
            with open(config_path) as f:
                if json.load(f).get("model_type") in ENCODER_HF_MODEL_TYPES:
                    return "encoder"
        return "decoder" if _sentence_transformers_pooling(path)[0] == "last" else None
    if path.endswith(".gguf"):
        fields = GGUFFile(path).fields
        arch = fields.get("general.architecture")
        if arch in ENCODER_GGUF_ARCHITECTURES:
            return "encoder"
        return "decoder" if int(fields.get(f"{arch}.pooling_type", 0)) == 3 else None
    return None


def resolve_task(path: str, task: str) -> tuple[str, bool]:
    """("generate" or "embed", whether an encoder serves it) for the model at `path`: "auto" is what the file is
    (an encoder, or a decoder its file marks as an embedding model, embeds); an encoder cannot generate. A
    decoder embeds by last-token pooling through the engine's scheduler (SamplingParams.pool)."""
    kind = embedding_kind(path)
    encoder = kind == "encoder"
    if task == "auto":
        return ("embed" if kind is not None else "generate"), encoder
    if task == "generate" and encoder:
        raise ValueError(f"{path} is an embedding model: serve it with --task embed (LLM(task='embed'))")
    return task, encoder
