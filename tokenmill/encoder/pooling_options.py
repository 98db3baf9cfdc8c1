"""What an operator and a request may ask of embeddings, for encoders and decoders alike: vLLM's --pooler-config
(pooling type, normalisation), --hf-overrides' matryoshka dimensions, and a request's `dimensions` (numpy,
torch-free: the API front end applies them)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenmill.encoder.config import POOLING_TYPES


def pooler_options(pooler_config: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's --pooler-config ({"pooling_type": "MEAN", "normalize": true}) -> {"pooling_type", "normalize"}."""
    options: dict[str, Any] = {}
    for key, value in (pooler_config or {}).items():
        if key == "pooling_type":
            pooling = str(value).lower()
            if pooling not in POOLING_TYPES:
                raise ValueError(f"pooling_type must be one of {', '.join(p.upper() for p in POOLING_TYPES)}, "
                                 f"got {value!r}")
            options[key] = pooling
        elif key == "normalize":
            options[key] = bool(value)
        else:
            raise ValueError(f"pooler_config takes pooling_type and normalize, not {key!r}")
    return options


def matryoshka_dimensions(hf_overrides: dict[str, Any] | None, hidden_size: int,
                          default: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The truncations a model allows: the operator's --hf-overrides (matryoshka_dimensions, or is_matryoshka:
    any size), else what its file says (`default`)."""
    overrides = hf_overrides or {}
    unknown = set(overrides) - {"matryoshka_dimensions", "is_matryoshka"}
    if unknown:
        raise ValueError(f"hf_overrides for embeddings take matryoshka_dimensions and is_matryoshka, not "
                         f"{sorted(unknown)}")
    if overrides.get("matryoshka_dimensions"):
        return tuple(int(d) for d in overrides["matryoshka_dimensions"])
    if overrides.get("is_matryoshka"):
        return (hidden_size,)
    return default


def l2_normalize(vectors: np.ndarray) -> np.ndarray:
    return vectors / np.maximum(np.linalg.norm(vectors, axis=-1, keepdims=True), 1e-12)


def cross_encoder_scores(logits: np.ndarray) -> list[float]:
    """A cross-encoder's relevance per pair: the sigmoid of its first label's logit (sentence-transformers'
    one-label default, vLLM's score)."""
    return (1 / (1 + np.exp(-logits[:, 0]))).tolist()


def cosine_scores(queries: np.ndarray, documents: np.ndarray) -> list[float]:
    """Cosine similarity of queries[i] and documents[i] (a single query row broadcasts over the documents)."""
    return (l2_normalize(queries) * l2_normalize(documents)).sum(-1).tolist()


def truncate_dimensions(vectors: np.ndarray, dimensions: int | None, allowed: tuple[int, ...] | None,
                        normalize: bool) -> np.ndarray:
    """Matryoshka: the first `dimensions` components, renormalised. ValueError where the model was not trained
    for it (`allowed` None) or the size is not one it allows (a single entry allows any size)."""
    if dimensions is None:
        return vectors
    if allowed is None:
        raise ValueError("this model does not support the dimensions parameter (not a matryoshka model)")
    hidden = vectors.shape[-1]
    if not 1 <= dimensions <= hidden or (len(allowed) > 1 and dimensions not in allowed):
        sizes = f"one of {list(allowed)}" if len(allowed) > 1 else f"1..{hidden}"
        raise ValueError(f"dimensions must be {sizes}, got {dimensions}")
    vectors = vectors[:, :dimensions]
    return l2_normalize(vectors) if normalize else vectors


def decoder_pooling(pooler_config: dict[str, Any] | None, hf_overrides: dict[str, Any] | None,
                    hidden_size: int) -> tuple[bool, tuple[int, ...] | None]:
    """(normalize, matryoshka dimensions) of a decoder served with task embed: last-token pooling only (a prompt
    runs in chunks, so only its last token's state is at hand at the end), normalised unless told otherwise."""
    options = pooler_options(pooler_config)
    if options.get("pooling_type", "last") != "last":
        raise ValueError("a decoder embeds by last-token pooling (pooling_type LAST): its prompt runs in chunks")
    return options.get("normalize", True), matryoshka_dimensions(hf_overrides, hidden_size, None)
