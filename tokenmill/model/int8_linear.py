"""The int8 linear backend: per-output-channel symmetric int8 weights; activations quantized dynamically, int8 x
int8 products summed exactly in int32. With the native kernel (AVX512-VNNI or AVX2) activations get one scale per
row and group of 32 input features (`kernels/int8_rows.c`, weights packed at load); elsewhere one scale per row
and two levels (the row and its residual) through `torch._int_mm` (oneDNN). Either way a row's output depends on
that row alone.
"""

from __future__ import annotations

import torch

from tokenmill import kernels
from tokenmill.model.linear import QuantLinear


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: x ~= q * scale, q in [-127, 127], scale [rows, 1] float32."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-10).div_(127.0)
    return torch.round(x / scale).to(torch.int8), scale


class Int8Linear(QuantLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias)
        self.qweight: torch.Tensor  # [out, in] int8 (oneDNN reads it as a [in, out] view)
        self.scale: torch.Tensor  # [out] float32 per output channel
        # The weights packed for the grouped VNNI kernel (kernels/int8_rows.c) where this CPU runs it; then
        # `qweight` serves only row lookups (a tied embedding) and layers without them drop it (`drop_rows`).
        self.packed: torch.Tensor | None = None
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.ones(out_features))

    def _load_weight(self, weight: torch.Tensor) -> None:
        qweight, scale = quantize_rows(weight)
        self._set_int8(qweight, scale.squeeze(1))

    def load_int8(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """The weight already quantized as `quantize_rows` does (int8 [out, in], scale [out]): GGUF blocks
        decoded and quantized in one native pass (loader.LazyWeights.int8_rows)."""
        if tuple(qweight.shape) != (self.out_features, self.in_features) or scale.shape != (self.out_features,):
            raise ValueError(f"int8 weight {tuple(qweight.shape)} / scale {tuple(scale.shape)} do not fit "
                             f"{(self.out_features, self.in_features)}")
        self._set_int8(qweight, scale)
        self._load_bias(bias)

    def _set_int8(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        self.qweight, self.scale = qweight.contiguous(), scale.contiguous()
        if kernels.int8_grouped_available() and self.in_features % kernels.INT8_GROUP == 0:
            self.packed = kernels.pack_vnni(self.qweight)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        if self.qweight.numel() == 0:
            raise RuntimeError("this layer dropped its row-major weights (drop_rows)")
        return self.qweight[index].float() * self.scale[index].unsqueeze(-1)

    def drop_rows(self) -> None:
        """Free the row-major copy where the packed one serves every product (one int8 copy of the weights)."""
        if self.packed is not None:
            self.qweight = torch.empty(0, dtype=torch.int8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).to(torch.float32)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        cpu = rows.device.type == "cpu"
        if cpu and self.packed is not None:
            y = kernels.int8_linear_grouped(rows, self.packed, self.scale, self.bias, self.out_features)
        elif cpu and kernels.int8_rows_available():
            q, scales = kernels.quantize_two_level(rows)
            acc = torch._int_mm(q, self.qweight.t())
            y = kernels.dequantize_two_level(acc, scales, self.scale, self.bias)
        else:
            q, scales = quantize_two_level(rows)
            y = dequantize_two_level(torch._int_mm(q, self.qweight.t()), scales, self.scale, self.bias)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


def quantize_two_level(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] -> int8 [2 * rows, cols] and scales [2 * rows]: each row, then its quantization residual.

    One int8 level per token costs this 135M model 3.8% perplexity and 5% of its top-1 choices (mostly at the
    RMSNorm-fed inputs, whose channels span a wide range); the residual level brings activations to ~14 bits, and
    both ride through one GEMM. The native kernel (kernels/int8_rows.c) does the same in one pass."""
    q1, s1 = quantize_rows(x)
    q2, s2 = quantize_rows(x - q1.float() * s1)
    return torch.cat([q1, q2]), torch.cat([s1, s2]).squeeze(1)


def dequantize_two_level(acc: torch.Tensor, scales: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    rows = acc.shape[0] // 2
    y = (acc[:rows].float() * scales[:rows, None] + acc[rows:].float() * scales[rows:, None]) * weight_scale
    return y if bias is None else y + bias
