"""An encoder's weights in one naming, from a Hugging Face directory (BERT; nomic-bert under nomic-ai's names
or transformers' NomicBert ones) or
a GGUF file (llama.cpp's `bert` / `nomic-bert` names), as float32 tensors.

Names: `word`, `position` (BERT), `token_type`, `embed_norm.{weight,bias}`; per layer `layers.N.` + `q`, `k`, `v`
(or a fused `qkv`), `out`, `attn_norm`, `up`, `gate` (nomic-bert), `down`, `mlp_norm`, each `.weight` and, where
the family has them, `.bias`; `pooler` and `classifier` for a cross-encoder.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tokenmill.model.gguf_file import GGUFFile

_HF_PREFIXES = ("bert.", "nomic_bert.", "model.")
_HF_NAMES = [  # (pattern, our name), first match wins
    (r"embeddings\.word_embeddings\.(weight)", "word"),
    (r"embeddings\.position_embeddings\.(weight)", "position"),
    (r"embeddings\.token_type_embeddings\.(weight)", "token_type"),
    (r"embeddings\.LayerNorm\.(weight|bias)", "embed_norm"),
    # BERT
    (r"encoder\.layer\.(\d+)\.attention\.self\.query\.(weight|bias)", "q"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.key\.(weight|bias)", "k"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.value\.(weight|bias)", "v"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.(weight|bias)", "out"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.(weight|bias)", "attn_norm"),
    (r"encoder\.layer\.(\d+)\.intermediate\.dense\.(weight|bias)", "up"),
    (r"encoder\.layer\.(\d+)\.output\.dense\.(weight|bias)", "down"),
    (r"encoder\.layer\.(\d+)\.output\.LayerNorm\.(weight|bias)", "mlp_norm"),
    # NomicBert (transformers)
    (r"layers\.(\d+)\.self_attn\.q_proj\.(weight)", "q"),
    (r"layers\.(\d+)\.self_attn\.k_proj\.(weight)", "k"),
    (r"layers\.(\d+)\.self_attn\.v_proj\.(weight)", "v"),
    (r"layers\.(\d+)\.self_attn\.o_proj\.(weight)", "out"),
    (r"layers\.(\d+)\.post_attention_layernorm\.(weight|bias)", "attn_norm"),
    (r"layers\.(\d+)\.mlp\.gate_proj\.(weight)", "gate"),
    (r"layers\.(\d+)\.mlp\.up_proj\.(weight)", "up"),
    (r"layers\.(\d+)\.mlp\.down_proj\.(weight)", "down"),
    (r"layers\.(\d+)\.post_mlp_layernorm\.(weight|bias)", "mlp_norm"),
    # nomic-bert as nomic-ai's checkpoints (and transformers' save_pretrained) name it
    (r"emb_ln\.(weight|bias)", "embed_norm"),
    (r"encoder\.layers\.(\d+)\.attn\.Wqkv\.(weight)", "qkv"),
    (r"encoder\.layers\.(\d+)\.attn\.out_proj\.(weight)", "out"),
    (r"encoder\.layers\.(\d+)\.mlp\.fc11\.(weight)", "up"),
    (r"encoder\.layers\.(\d+)\.mlp\.fc12\.(weight)", "gate"),
    (r"encoder\.layers\.(\d+)\.mlp\.fc2\.(weight)", "down"),
    (r"encoder\.layers\.(\d+)\.norm1\.(weight|bias)", "attn_norm"),
    (r"encoder\.layers\.(\d+)\.norm2\.(weight|bias)", "mlp_norm"),
    # cross-encoder head
    (r"pooler\.dense\.(weight|bias)", "pooler"),
    (r"classifier\.(weight|bias)", "classifier"),
]
_HF_PATTERNS = [(re.compile(pattern + "$"), name) for pattern, name in _HF_NAMES]
_GGUF_GLOBAL = {"token_embd": "word", "position_embd": "position", "token_types": "token_type",
                "token_embd_norm": "embed_norm", "cls": "pooler", "cls.output": "classifier"}
_GGUF_LAYER = {"attn_qkv": "qkv", "attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "out",
               "attn_output_norm": "attn_norm", "ffn_up": "up", "ffn_gate": "gate", "ffn_down": "down",
               "layer_output_norm": "mlp_norm"}
# tensors an encoder file may carry that serving embeddings does not use (a masked-LM head)
_UNUSED_HF = re.compile(r"(cls\.predictions\..*|.*position_ids|.*token_type_ids|lm_head\..*)$")


def our_name(hf_name: str) -> str | None:
    """Our name for a transformers tensor name; None for a tensor embeddings do not use."""
    name = hf_name
    for prefix in _HF_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    for pattern, ours in _HF_PATTERNS:
        match = pattern.match(name)
        if match:
            *layer, kind = match.groups()
            return f"layers.{layer[0]}.{ours}.{kind}" if layer else f"{ours}.{kind}"
    if _UNUSED_HF.match(name):
        return None
    raise ValueError(f"unexpected tensor {hf_name!r} in an encoder checkpoint")


def load_hf_weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                ours = our_name(name)
                if ours is not None:
                    weights[ours] = f.get_tensor(name).to(torch.float32)
    return weights


def load_gguf_weights(reader: GGUFFile) -> dict[str, torch.Tensor]:
    from tokenmill.model.loader import dequantize_tensor

    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        stem, kind = tensor.name.rsplit(".", 1)
        if stem in _GGUF_GLOBAL:
            name = f"{_GGUF_GLOBAL[stem]}.{kind}"
        else:
            parts = stem.split(".")
            if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _GGUF_LAYER:
                raise ValueError(f"unexpected tensor {tensor.name!r} in an encoder GGUF")
            name = f"layers.{parts[1]}.{_GGUF_LAYER[parts[2]]}.{kind}"
        weights[name] = dequantize_tensor(tensor).to(torch.float32)
    return weights


def load_encoder_weights(path: str, reader: GGUFFile | None = None) -> dict[str, torch.Tensor]:
    if Path(path).is_dir():
        return load_hf_weights(path)
    return load_gguf_weights(reader or GGUFFile(path))
