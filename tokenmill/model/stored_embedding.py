"""An embedding table read where the GGUF file stores it: rows decoded from the file's blocks on lookup.

A step looks up one row per token, so decoding them on demand costs microseconds, while a float32 copy of a
150k-word table would cost ~550 MB (Qwen2.5-0.5B) and an int8 one ~140 MB. The rows come from the file's
memory map (clean, shared pages the kernel can drop), bit-identical to the `gguf` package's dequantization.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tokenmill import kernels


class StoredEmbedding(nn.Module):
    def __init__(self, data: np.ndarray, tensor_type: int, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.data, self.tensor_type = data, tensor_type
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = kernels.gguf_gather_rows(self.data, self.tensor_type, self.num_embeddings, self.embedding_dim,
                                        input_ids.reshape(-1).cpu())
        return rows.reshape(*input_ids.shape, self.embedding_dim).to(input_ids.device)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, GGUF type {self.tensor_type}, read from the file"
