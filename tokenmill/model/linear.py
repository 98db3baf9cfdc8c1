"""The linear-layer interface every backend implements (`QuantLinear`), and its float backends.

A layer gets its float32 weight once, at load (`load`), converts it and keeps only its own form, so no full
float32 copy of the model stays in memory. Activations between layers stay float32 in every mode.

- `Float32Linear` (`none`): float32 `F.linear`, token-exact with transformers.
- `BF16Linear` (`bf16`): bf16 weights and inputs (oneDNN), float32 outputs. Fast where the CPU has native bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class QuantLinear(nn.Module):
    """y = x @ W.T + b for x [..., in_features]; W arrives once, in float32, through `load`."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight shape {tuple(weight.shape)} != {(self.out_features, self.in_features)}")
        self._load_weight(weight.to(torch.float32))
        self._load_bias(bias)

    def _load_bias(self, bias: torch.Tensor | None) -> None:
        if self.bias is not None:
            if bias is None:
                raise ValueError("this layer has a bias but none was given")
            self.bias.data.copy_(bias)

    def _load_weight(self, weight: torch.Tensor) -> None:
        raise NotImplementedError

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows of the weight as the kernel sees them, in float32: a tied LM head doubles as the embedding."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Float32Linear(QuantLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias)
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def _load_weight(self, weight: torch.Tensor) -> None:
        self.weight.data = weight.contiguous()

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        return F.embedding(index, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class BF16Linear(QuantLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias)
        self.weight: torch.Tensor
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.bfloat16))

    def _load_weight(self, weight: torch.Tensor) -> None:
        self.weight = weight.to(torch.bfloat16).contiguous()

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        return F.embedding(index, self.weight).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)
        return y if self.bias is None else y + self.bias
