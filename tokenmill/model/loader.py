"""Weight loading: GGUF files and HF directories with safetensors.

Both paths return a `ModelConfig` and a state dict in Hugging Face naming
(`model.layers.0.self_attn.q_proj.weight`, ...) with float32 tensors, so the model has one loading path.
The state dict is lazy: a tensor is read (and a GGUF tensor dequantized) only when it is looked up, so the
model can convert weights one at a time (int8, bf16) without a float32 copy of the whole model in memory.
GGUF blocks are decoded in native code straight from the file's map (kernels/gguf_blocks.c, bit-identical to
the `gguf` package's numpy code, which remains the fallback and serves the types the kernel lacks), and an int8
layer can take its rows quantized during that decoding (`LazyWeights.int8_rows`), with no float32 copy at all.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tokenmill import kernels
from tokenmill.config import ModelConfig
from tokenmill.model import families
from tokenmill.model.families import Family
from tokenmill.model.gguf_file import GGUFFile, GGUFTensor
from tokenmill.model.gguf_linear import StoredBlocks
from tokenmill.model.metadata import bundled_model_path, gguf_field, read_metadata, resolve_model_path
from tokenmill.model.stored_embedding import StoredEmbedding
from tokenmill.platform import release_freed_heap

__all__ = ["LazyWeights", "LoadedModel", "bundled_model_path", "dequantize_tensor", "gguf_field", "load_model",
           "resolve_model_path"]

_DEQUANT_ROWS = 4096


Int8Rows = tuple[torch.Tensor, torch.Tensor]  # int8 [rows, cols] and float32 scale [rows] (int8_linear.quantize_rows)


class LazyWeights(Mapping[str, torch.Tensor]):
    """A read-only state dict whose tensors are produced on each lookup (nothing is cached)."""

    def __init__(self, readers: dict[str, Callable[[], torch.Tensor]],
                 blocks: dict[str, StoredBlocks] | None = None,
                 stored: dict[str, StoredEmbedding] | None = None) -> None:
        """`blocks`: the tensors the native decoder reads from a GGUF's map (each can drop its file pages once
        converted); `stored`: the embedding tables looked up there."""
        self._readers = readers
        self._blocks = blocks or {}
        self._stored = stored or {}

    def stored_embedding(self, name: str) -> StoredEmbedding | None:
        """The [rows, cols] tensor as a lookup table over the file's own bytes, where the file allows."""
        return self._stored.get(name)

    def stored_blocks(self, name: str) -> StoredBlocks | None:
        """The [rows, cols] tensor as its blocks in the file (to execute as stored), where it is a GGUF's."""
        return self._blocks.get(name)

    def int8_rows(self, name: str) -> Int8Rows | None:
        """The tensor as per-row int8 made straight from the file's blocks, where the file allows; else None."""
        blocks = self._blocks.get(name)
        if blocks is None:
            return None
        release_freed_heap()
        q, scale = kernels.gguf_to_int8_rows(blocks.data, blocks.tensor_type, blocks.rows, blocks.cols)
        if blocks.release is not None and name not in self._stored:  # an embedding table is read on
            blocks.release()
        order = blocks.row_order
        return (q, scale) if order is None else (q[order], scale[order])

    def __getitem__(self, name: str) -> torch.Tensor:
        # glibc keeps freed float32 tensors in its heap; hand them back before reading the next one, or peak
        # memory at load grows by the fragments of every tensor already converted (~400 MB on SmolLM2).
        release_freed_heap()
        return self._readers[name]()

    def __contains__(self, name: object) -> bool:
        # Mapping's default would read (and dequantize) the tensor to answer
        return name in self._readers

    def __iter__(self) -> Iterator[str]:
        return iter(self._readers)

    def __len__(self) -> int:
        return len(self._readers)


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: Mapping[str, torch.Tensor]
    path: str
    gguf_reader: GGUFFile | None = None  # kept so the tokenizer need not parse the file again


def load_model(model: str | None) -> LoadedModel:
    """The model's metadata and its lazy weights (nothing is read until a weight is looked up)."""
    metadata = read_metadata(model)
    assert metadata.family is not None
    if metadata.gguf_reader is None:
        weights = _load_hf_dir(metadata.path, metadata.family)
    else:
        weights = _load_gguf(metadata.gguf_reader, metadata.config, metadata.family)
    return LoadedModel(metadata.config, weights, metadata.path, metadata.gguf_reader)


# ---------------------------------------------------------------- GGUF


def _reverse_rotary_permutation(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (it interleaves the two rotary halves of every head)."""
    rows = weight.shape[0]
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _shape(tensor: GGUFTensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first


def _natively_decodable(tensor: GGUFTensor) -> bool:
    return kernels.gguf_decodable(int(tensor.tensor_type), _shape(tensor)[-1])


def dequantize_tensor(tensor: GGUFTensor) -> torch.Tensor:
    shape = _shape(tensor)
    if _natively_decodable(tensor):
        return kernels.gguf_dequantize(tensor.data, int(tensor.tensor_type), math.prod(shape[:-1]),
                                       shape[-1]).reshape(shape)
    from gguf.quants import dequantize

    value = torch.empty(shape, dtype=torch.float32)
    rows = value.view(-1, shape[-1])
    # Dequantize a few rows at a time: numpy's intermediates for a whole embedding table are ~5x its size.
    for start in range(0, rows.shape[0], _DEQUANT_ROWS):
        chunk = dequantize(tensor.data[start:start + _DEQUANT_ROWS], tensor.tensor_type)
        chunk = np.array(chunk, dtype=np.float32).reshape(-1, shape[-1])
        rows[start:start + _DEQUANT_ROWS] = torch.from_numpy(chunk)
    return value


def _load_gguf(reader: GGUFFile, config: ModelConfig, family: Family) -> LazyWeights:

    def rows_in_hf_order(value: torch.Tensor, name: str) -> torch.Tensor:
        if family.gguf_rotary_permuted and name.endswith("q_proj.weight"):
            return _reverse_rotary_permutation(value, config.num_heads)
        if family.gguf_rotary_permuted and name.endswith("k_proj.weight"):
            return _reverse_rotary_permutation(value, config.num_kv_heads)
        return value

    def reader_of(tensor: GGUFTensor, name: str) -> Callable[[], torch.Tensor]:
        def read() -> torch.Tensor:
            value = dequantize_tensor(tensor)
            if name not in stored:  # an embedding table is read on
                reader.release(tensor)
            return rows_in_hf_order(value, name)

        return read

    readers: dict[str, Callable[[], torch.Tensor]] = {}
    stored: dict[str, StoredEmbedding] = {}
    blocks: dict[str, StoredBlocks] = {}
    for tensor in reader.tensors:
        if tensor.name in families.GGUF_CONFIG_TENSORS:
            continue
        name = families.hf_tensor_name(tensor.name, family)
        readers[name] = reader_of(tensor, name)
        if len(tensor.shape) == 2 and _natively_decodable(tensor):
            rows, cols = _shape(tensor)
            order = rows_in_hf_order(torch.arange(rows), name)
            blocks[name] = StoredBlocks(tensor.data.reshape(rows, -1), int(tensor.tensor_type), rows, cols,
                                        None if torch.equal(order, torch.arange(rows)) else order,
                                        functools.partial(reader.release, tensor))
            if name == "model.embed_tokens.weight" and not config.tie_word_embeddings:
                stored[name] = StoredEmbedding(blocks[name])
    return LazyWeights(readers, blocks, stored)


# ---------------------------------------------------------------- HF directory


def _load_hf_dir(path: str, family: Family) -> LazyWeights:
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    # Gemma stores RMSNorm weights as w for a (1 + w) scale; the model (and GGUF files) hold 1 + w.
    norm_offset = 1.0 if family.gemma else 0.0

    def reader_of(file: str, name: str) -> Callable[[], torch.Tensor]:
        def read() -> torch.Tensor:
            with safe_open(file, framework="pt") as f:
                value = f.get_tensor(name).to(torch.float32)
            return value + norm_offset if norm_offset and name.endswith("norm.weight") else value

        return read

    readers = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                readers[name] = reader_of(str(file), name)
    return LazyWeights(readers)
