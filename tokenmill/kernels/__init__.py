"""Native CPU kernels: small C files compiled at first use for this machine, loaded with ctypes.

Plain C with no Python or torch headers compiles in about a second with the system's gcc (torch's
`cpp_extension` would take a minute on two cores). Where no compiler is available the callers fall back to
their pure-torch paths, so the kernels are a speed-up, never a requirement.

One module per kernel family loads its library and wraps its calls (`build.py` compiles and loads); this
package is their one face to the rest of the code (`kernels.paged_attention(...)`), and `prepare` builds them all.
"""

from __future__ import annotations

from tokenmill.isa import cpu_level
from tokenmill.kernels.build import build_flags, cache_dir, load_library
from tokenmill.kernels.decoder_stack import (
    DecoderLayerPointers,
    LinearPointers,
    decoder_forward,
    decoder_stack_available,
    decoder_work_floats,
)
from tokenmill.kernels.gguf_ops import (
    GGUFMatmulPlan,
    gguf_decodable,
    gguf_decoding_available,
    gguf_dequantize,
    gguf_gather_rows,
    gguf_matmul,
    gguf_matmul_supported,
    gguf_panels_available,
    gguf_to_int8_rows,
)
from tokenmill.kernels.int8_ops import (
    INT8_GROUP,
    dequantize_two_level,
    int8_grouped_available,
    int8_linear_grouped,
    int8_rows_available,
    pack_vnni,
    quantize_groups,
    quantize_two_level,
)
from tokenmill.kernels.kv_attention import (
    attention_bf16_available,
    attention_supported,
    bf16_cache_supported,
    bf16_dot_attention,
    bf16_softmax_weights,
    cache_pointers,
    integer_attention,
    key_channel_pointer,
    native_attention_available,
    paged_attention,
)
from tokenmill.kernels.layer_ops import (
    add_rms_norm,
    gated_activation,
    layer_ops_available,
    layer_ops_supported,
    rms_norm_heads,
    rope_and_cache,
)
from tokenmill.kernels.lora_ops import LoRABatchPointers, LoRAWeightsPointers, lora_add, lora_add_supported
from tokenmill.kernels.token_bitmask import apply_token_bitmask, token_bitmask_available, token_bitmask_supported
from tokenmill.platform import isa_level, raw_cpu_flags

__all__ = [
    "INT8_GROUP", "DecoderLayerPointers", "GGUFMatmulPlan", "LinearPointers", "LoRABatchPointers",
    "LoRAWeightsPointers", "add_rms_norm", "apply_token_bitmask", "attention_bf16_available", "attention_supported",
    "bf16_cache_supported", "bf16_dot_attention", "bf16_softmax_weights", "build_flags", "cache_dir", "cache_pointers",
    "decoder_forward", "decoder_stack_available", "decoder_work_floats", "dequantize_two_level", "gated_activation",
    "gguf_decodable", "gguf_decoding_available", "gguf_dequantize", "gguf_gather_rows", "gguf_matmul",
    "gguf_matmul_supported", "gguf_panels_available", "gguf_to_int8_rows", "int8_grouped_available",
    "int8_linear_grouped", "int8_rows_available", "integer_attention", "key_channel_pointer", "layer_ops_available",
    "layer_ops_supported", "load_library", "lora_add", "lora_add_supported", "native_attention_available", "pack_vnni",
    "paged_attention", "prepare", "quantize_groups", "quantize_two_level", "rms_norm_heads", "rope_and_cache",
    "token_bitmask_available", "token_bitmask_supported",
]


def prepare() -> str:
    """Build every kernel now (at start-up, not in the first request's step); returns a line for the log."""
    ready = {
        "attention": native_attention_available(),
        "int8 rows": int8_rows_available(),
        "grouped int8 GEMM": int8_grouped_available(),
        "layer ops": layer_ops_available(),
        "token bitmask": token_bitmask_available(),
        "decoder stack": decoder_stack_available(),
        "GGUF block decoding": gguf_decoding_available(),
        "GGUF panels": gguf_panels_available(),
    }
    level = isa_level()
    target = f"{level} (TOKENMILL_ISA)" if level else "this CPU's own: " + cpu_level(raw_cpu_flags())
    return (f"native CPU kernels for {target}: "
            + ", ".join(f"{name} {'on' if on else 'off'}" for name, on in ready.items()))
