"""Linear-layer backends: float32, bf16 and int8 weights behind one `forward(x)`.

The model builds every projection (and the LM head) through `make_linear(mode, ...)` and hands each one its
float32 weight once, at load (`load`), which converts and keeps only the backend's own form, so no full
float32 copy of the model stays in memory. Activations between layers stay float32 in every mode.

- `none`: float32 `F.linear`, token-exact with transformers.
- `bf16`: bf16 weights and inputs (oneDNN), float32 outputs. Fast where the CPU has native bf16.
- `int8`: per-output-channel symmetric int8 weights; activations quantized dynamically, int8 x int8 products
  summed exactly in int32. With the native kernel (AVX512-VNNI or AVX2) activations get one scale per row and
  group of 32 input features (`kernels/int8_rows.c`, weights packed at load); elsewhere one scale per row and two
  levels (the row and its residual) through `torch._int_mm` (oneDNN). Either way a row's output depends on that
  row alone.
- `gguf`: a GGUF file's quantized blocks executed as stored (model/gguf_linear.py); other layers int8.
- `auto`: the fastest of the above that this machine supports (`resolve_quantization`).
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import kernels
from tokenmill.isa import cpu_level
from tokenmill.platform import cpu_flags, isa_level

QuantizationMode = Literal["auto", "none", "int8", "bf16", "gguf"]
QUANTIZATION_MODES: tuple[str, ...] = ("auto", "none", "int8", "bf16", "gguf")
logger = logging.getLogger(__name__)


def resolve_quantization(mode: str, device: str, gguf_weights: bool = False) -> str:
    """`auto` -> the fastest supported mode on this device; explicit modes are checked against the hardware.

    Measured on this project's CPUs (benchmarks/bench_kernels.py): int8 through the native grouped kernel is the
    fastest at every batch size on AVX-512 VNNI hosts (2-4x float32); on AVX2-only hosts, where bf16 has no native
    instructions, it runs through the kernel's AVX2 branch. A GGUF file's own blocks (`gguf_weights`), repacked
    into row panels (gguf_panels.c, AVX512-VNNI or AVX2), stream fewer bytes than int8 and decode faster: on
    AVX512-VNNI bundled SmolLM2 Q4_1 1.4x, Qwen2.5-0.5B Q4_K_M 1.1x; with the AVX2 kernels (TOKENMILL_ISA=avx2)
    1.03-1.17x at one stream, 1.1-1.24x at 8, prompts 1.09-1.37x (docs/BENCHMARKS.md "gguf", "gguf-avx2"); so
    there `auto` is `gguf`. Where no panel kernel is built (no AVX2), int8 or float32. On CPUs where the native
    kernels cannot be built, `auto` keeps float32. On GPUs `auto` is bf16 where the device computes in bf16
    (float32 otherwise).
    """
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {mode!r}")
    if torch.device(device).type != "cpu":
        if mode in ("int8", "gguf"):
            raise ValueError(f"{mode} quantization is implemented for CPU only; use 'bf16' or 'none' on GPUs")
        if mode == "auto":
            return "bf16" if _gpu_has_bf16(device) else "none"
        return mode
    flags = cpu_flags()
    has_int8 = bool(flags & {"avx2", "avx512_vnni", "avx_vnni", "asimddp", "i8mm"})
    has_bf16 = bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    if mode == "auto":
        # Quantized modes are batch-invariant only with the native attention kernel (the torch fallback rounds
        # differently per chunk size, which int8/bf16 activations amplify): without it, stay exact in float32.
        if not kernels.native_attention_available():
            logger.warning("native CPU kernels unavailable (no C compiler?): running float32")
            return "none"
        chosen = ("gguf" if gguf_weights and kernels.gguf_panels_available()
                  else "int8" if has_int8 else "bf16" if has_bf16 else "none")
        logger.info("quantization auto -> %s (kernels for %s%s)", chosen, isa_level() or cpu_level(cpu_flags()),
                    ", a GGUF file: its blocks as stored" if chosen == "gguf" else "")
        return chosen
    if mode == "bf16" and not has_bf16:
        logger.warning("this CPU has no native bf16 instructions: bf16 linears will be slow")
    return mode


def _gpu_has_bf16(device: str) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


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


_BACKENDS: dict[str, type[QuantLinear]] = {"none": Float32Linear, "bf16": BF16Linear, "int8": Int8Linear}


def make_linear(mode: str, in_features: int, out_features: int, bias: bool = False) -> QuantLinear:
    """An unloaded linear layer of the given (resolved) mode."""
    if mode == "gguf":
        from tokenmill.model.gguf_linear import GGUFLinear

        return GGUFLinear(in_features, out_features, bias)
    if mode not in _BACKENDS:
        raise ValueError(f"unresolved or unknown quantization mode {mode!r}")
    return _BACKENDS[mode](in_features, out_features, bias)
