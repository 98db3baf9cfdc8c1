"""An embedding table read where the GGUF file stores it: rows decoded from the file's blocks on lookup.

A step looks up one row per token, so decoding them on demand costs microseconds, while a float32 copy of a
150k-word table would cost ~550 MB (Qwen2.5-0.5B) and an int8 one ~140 MB. The rows come from the file's
memory map (clean, shared pages the kernel can drop), bit-identical to the `gguf` package's dequantization.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.model.gguf_linear import StoredBlocks


class StoredEmbedding(nn.Module):
    def __init__(self, blocks: StoredBlocks) -> None:
        super().__init__()
        self.blocks = blocks

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.blocks.gather(input_ids)

    def extra_repr(self) -> str:
        b = self.blocks
        return f"{b.rows}, {b.cols}, GGUF type {b.tensor_type}, read from the file"
