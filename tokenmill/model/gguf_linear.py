"""The `gguf` linear backend: a GGUF file's quantized weights executed as the file stores them.

A layer holds, per stored tensor it fuses (q, k and v; gate and up), the tensor's blocks: on AVX512-VNNI hosts
repacked at load into the 16-row panels `kernels/gguf_panels.c` reads (the same bits, interleaved; the file's
pages are then dropped), elsewhere a view into the file's memory map (no copy: the pages are the file's, shared
and clean) that `kernels/gguf_matmul.c` reads. Either way activations are quantized to int8 per group of 32 and
multiplied by the blocks' integers, as llama.cpp does. A
layer whose tensors the kernel lacks (F16/F32 weights, Q2_K, Q3_K, the IQ types), and any layer loaded from
float32 weights (a Hugging Face directory), is an int8 layer instead, so `--quantization gguf` runs any model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill import kernels
from tokenmill.model.int8_linear import Int8Linear
from tokenmill.model.linear import QuantLinear


@dataclass
class StoredBlocks:
    """A GGUF tensor [rows, cols] as its blocks in the file, and the order its rows take in the model."""

    data: np.ndarray  # bytes [rows, row bytes], a view into the file's map
    tensor_type: int
    rows: int
    cols: int
    row_order: torch.Tensor | None = None  # model row i is stored row row_order[i] (llama.cpp's q/k permutation)
    release: Callable[[], None] | None = None  # drops the tensor's file pages (they fault in again if read)

    @property
    def executable(self) -> bool:
        return kernels.gguf_matmul_supported(self.tensor_type, self.cols)

    def gather(self, index: torch.Tensor) -> torch.Tensor:
        """float32 [*index.shape, cols]: the model rows `index`, decoded from the file's blocks."""
        stored = index if self.row_order is None else self.row_order[index]
        flat = kernels.gguf_gather_rows(self.data, self.tensor_type, self.rows, self.cols, stored.reshape(-1).cpu())
        return flat.reshape(*index.shape, self.cols).to(index.device)


class GGUFLinear(QuantLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias)
        self.parts: list[tuple[StoredBlocks, torch.Tensor | None]] = []  # (blocks, stored row of each output)
        self.plan: kernels.GGUFMatmulPlan | None = None
        self.fallback: Int8Linear | None = None

    def load_stored(self, parts: list[StoredBlocks], bias: torch.Tensor | None = None,
                    rows: torch.Tensor | None = None) -> bool:
        """Execute these tensors, stacked by rows in this order, as stored; `rows` reorders the stacked rows
        within each tensor (partial rotary). False (nothing changed) where the kernel lacks one of them."""
        if not all(part.executable and part.cols == self.in_features for part in parts):
            return False
        if sum(part.rows for part in parts) != self.out_features:
            raise ValueError(f"stored rows {[p.rows for p in parts]} do not make {self.out_features} outputs")
        start = 0
        for part in parts:
            local = torch.arange(part.rows) if rows is None else rows[start:start + part.rows] - start
            if int(local.min()) < 0 or int(local.max()) >= part.rows:
                raise ValueError("a row order may only reorder rows within each stored tensor")
            order = local if part.row_order is None else part.row_order[local]
            identity = bool(torch.equal(order, torch.arange(part.rows)))
            self.parts.append((part, None if identity else order.to(torch.int64).contiguous()))
            start += part.rows
        self.plan = kernels.GGUFMatmulPlan([(p.data, p.tensor_type, p.rows, order) for p, order in self.parts],
                                           self.in_features)
        if self.plan.panels:  # repacked: the kernel no longer reads the file's pages
            for part in parts:
                if part.release is not None:
                    part.release()
        self._load_bias(bias)
        return True

    def _load_weight(self, weight: torch.Tensor) -> None:
        self.fallback = Int8Linear(self.in_features, self.out_features, bias=False)
        self.fallback.load(weight)

    def load_int8(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.fallback = Int8Linear(self.in_features, self.out_features, bias=False)
        self.fallback.load_int8(qweight, scale)
        self._load_bias(bias)

    def drop_rows(self) -> None:
        if self.fallback is not None:
            self.fallback.drop_rows()

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        if self.fallback is not None:
            return self.fallback.rows(index)
        (part, _), = self.parts  # an embedding table is one tensor, its rows in order
        return part.gather(index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        if self.fallback is not None:
            y = self.fallback(rows)
            y = y if self.bias is None else y + self.bias
        else:
            assert self.plan is not None
            y = kernels.gguf_matmul(rows, self.plan, self.bias)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kinds = "int8" if self.fallback is not None else ",".join(str(p.tensor_type) for p, _ in self.parts)
        return super().extra_repr() + f", weights={kinds}"
