"""Choosing the linear layers' backend (`--quantization`) and making them: `resolve_quantization` picks what
this machine runs best, `make_linear` builds an unloaded layer of a resolved mode.

- `none`: float32, token-exact with transformers; `bf16`: bf16 weights (model/linear.py).
- `int8`: int8 rows, activations quantized dynamically (model/int8_linear.py).
- `gguf`: a GGUF file's quantized blocks executed as stored (model/gguf_linear.py); other layers int8.
- `auto`: the fastest of the above that this machine supports (`resolve_quantization`).
"""

from __future__ import annotations

import logging
from typing import Literal

import torch

from tokenmill import kernels
from tokenmill.isa import cpu_level
from tokenmill.model.gguf_linear import GGUFLinear
from tokenmill.model.int8_linear import Int8Linear
from tokenmill.model.linear import BF16Linear, Float32Linear, QuantLinear
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


_BACKENDS: dict[str, type[QuantLinear]] = {"none": Float32Linear, "bf16": BF16Linear, "int8": Int8Linear}


def make_linear(mode: str, in_features: int, out_features: int, bias: bool = False) -> QuantLinear:
    """An unloaded linear layer of the given (resolved) mode."""
    if mode == "gguf":
        return GGUFLinear(in_features, out_features, bias)
    if mode not in _BACKENDS:
        raise ValueError(f"unresolved or unknown quantization mode {mode!r}")
    return _BACKENDS[mode](in_features, out_features, bias)
