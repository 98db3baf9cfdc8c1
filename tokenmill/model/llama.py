"""The decoder of the Llama lineage: RMSNorm, RoPE, grouped-query attention, a gated MLP, with the options its
families add (`ModelConfig`: QK-norm, sandwich norms, GeGLU, scaled embeddings, sliding windows, rope scaling).

`forward` runs over one flat token batch that mixes prompt chunks and decode tokens of many sequences; the
attention layers read the paged KV cache through `AttentionMetadata`. q/k/v and gate/up projections are fused
into one matmul each (fewer, larger GEMMs are faster on every backend).
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import kernels
from tokenmill.config import ModelConfig
from tokenmill.kernels import triton_ops
from tokenmill.lora.slots import LayerLoRA, LoRAContext, LoRASlots
from tokenmill.model import kv_quant
from tokenmill.model.attention import AttentionMetadata, gpu_kernels_apply, paged_attention
from tokenmill.model.gguf_linear import GGUFLinear
from tokenmill.model.int8_linear import Int8Linear
from tokenmill.model.key_smoothing import channel_sizes, key_channel_scales
from tokenmill.model.linear import QuantLinear
from tokenmill.model.loader import LazyWeights
from tokenmill.model.quant import make_linear
from tokenmill.model.rope import RopeTables, RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(r), r) with r = x + residual (x alone when there is no residual yet), vLLM's fused form.

        The native kernel adds into `residual` in place; the residual stream belongs to the forward pass."""
        if kernels.layer_ops_supported(x):
            if residual is None:
                return kernels.add_rms_norm(x, None, self.weight, self.eps), x
            return kernels.add_rms_norm(residual, x, self.weight, self.eps), residual
        if residual is not None:
            x = x + residual
        return self.plain(x), x

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm(x) over the last dimension, no residual (computed in float32, as transformers does)."""
        if x.dim() == 2 and x.is_contiguous() and kernels.layer_ops_supported(x):
            return kernels.add_rms_norm(x, None, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, quantization: str, window: int | None = None) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = make_linear(quantization, config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias)
        self.o_proj = make_linear(quantization, self.q_size, config.hidden_size)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.scale = config.softmax_scale
        self.window = window  # keys a query sees (itself included) on a sliding-window layer; None: all
        self.kv_cache: kv_quant.LayerKV | None = None  # bound by the model runner
        # an int8 cache's key channel scales (model/key_smoothing.py), set by load_weights
        self.key_channel_scale = torch.ones(self.num_kv_heads, self.head_dim)
        self.lora: LayerLoRA | None = None  # multi-LoRA: adds the step's adapter deltas (attach_lora)

    def _norm_heads(self, qkv: torch.Tensor) -> None:
        """QK-norm, in place on the fused projection: each head's q and k through its RMSNorm."""
        assert self.q_norm is not None and self.k_norm is not None
        if kernels.layer_ops_supported(qkv):  # the kernel the native decoder stack calls
            kernels.rms_norm_heads(qkv, self.num_heads, self.q_norm.weight, self.q_norm.eps)
            kernels.rms_norm_heads(qkv[:, self.q_size:], self.num_kv_heads, self.k_norm.weight, self.k_norm.eps)
            return
        tokens = qkv.shape[0]
        for norm, start, heads in ((self.q_norm, 0, self.num_heads),
                                   (self.k_norm, self.q_size, self.num_kv_heads)):
            part = qkv[:, start:start + heads * self.head_dim]
            part.copy_(norm.plain(part.reshape(tokens * heads, self.head_dim)).view(tokens, -1))

    def forward(self, x: torch.Tensor, rope: RopeTables, meta: AttentionMetadata) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("KV cache not bound: the model runner allocates it before the first step")
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.lora is not None:
            self.lora.add("qkv", x, qkv)
        if self.q_norm is not None:
            self._norm_heads(qkv)
        cache = self.kv_cache
        cos, sin = rope
        native = (kernels.layer_ops_supported(qkv)
                  and kernels.attention_supported(qkv, self.num_heads, cache))
        if native:
            q = kernels.rope_and_cache(qkv, self.num_heads, self.num_kv_heads, cos, sin, meta.slot_mapping, cache)
            out = torch.empty_like(q)
            kernels.paged_attention(out, q, cache, meta.query_start, meta.seq_lens, meta.block_tables, self.scale,
                                    self.window)
        elif gpu_kernels_apply(qkv, cache):  # CUDA: the same two fused steps in Triton
            q = triton_ops.rope_and_cache(qkv, self.num_heads, self.num_kv_heads, cos, sin, meta.slot_mapping,
                                          cache)
            out = torch.empty_like(q)
            triton_ops.paged_attention(out, q, cache, meta.query_start, meta.seq_lens, meta.block_tables, self.scale,
                                       self.window)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(tokens, self.num_heads, self.head_dim)
            k = k.view(tokens, self.num_kv_heads, self.head_dim)
            v = v.view(tokens, self.num_kv_heads, self.head_dim)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q, k = kv_quant.smooth_keys(apply_rope(q, cos, sin), apply_rope(k, cos, sin), cache)
            kv_quant.write(cache, k, v, meta.slot_mapping)
            out = paged_attention(q, k, v, cache, meta, self.scale, self.window)
        out = out.reshape(tokens, self.q_size)
        y = self.o_proj(out)
        return y if self.lora is None else self.lora.add("o", out, y)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, quantization: str) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gelu = config.hidden_act == "gelu_tanh"
        self.gate_up_proj = make_linear(quantization, config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = make_linear(quantization, config.intermediate_size, config.hidden_size)
        self.lora: LayerLoRA | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.lora is not None:
            self.lora.add("gate_up", x, gate_up)
        if kernels.layer_ops_supported(gate_up):
            act = kernels.gated_activation(gate_up, self.gelu)
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            act = (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up
        y = self.down_proj(act)
        return y if self.lora is None else self.lora.add("down", act, y)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, quantization: str, window: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, quantization, window)
        # the norm in front of the MLP (Gemma calls it pre_feedforward_layernorm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, quantization)
        # Gemma's sandwich: the attention and MLP outputs are normalized before their residual adds
        sandwich = config.sandwich_norm
        self.attn_output_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if sandwich else None
        self.mlp_output_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if sandwich else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeTables,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it is added): vLLM's layout, so each residual
        add fuses with the RMSNorm after it."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, meta)
        if self.attn_output_norm is not None:
            h = self.attn_output_norm.plain(h)
        h, residual = self.post_attention_layernorm(h, residual)
        h = self.mlp(h)
        if self.mlp_output_norm is not None:
            h = self.mlp_output_norm.plain(h)
        return h, residual


class NativeDecoderStack:
    """All decoder layers in one native call per step (kernels/decoder.c), each projection int8 or a GGUF
    file's own blocks (`--quantization int8`, `gguf`), with every family option of DecoderLayer: the kernels the
    layers above call one by one, in the same order, so the results are bit-identical, without the per-layer
    Python, ctypes and allocation overhead (~2 ms of a ~10 ms batch-1 step on SmolLM2; on Gemma 3 270M, whose
    layers do more small operations, about 11 of 23 ms). Holds the layers' raw addresses:
    weights and KV caches never move once bound."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        layers = model.decoder_layers
        config = model.config
        self.caches: list[kv_quant.LayerKV] = []
        self.plans: list[kernels.GGUFMatmulPlan] = []  # the arrays the GGUF projections' pointers point into
        for layer in layers:
            assert layer.self_attn.kv_cache is not None
            self.caches.append(layer.self_attn.kv_cache)
        self.pointers = (kernels.DecoderLayerPointers * len(layers))()
        for slot, layer in zip(self.pointers, layers):
            attn, mlp = layer.self_attn, layer.mlp
            linears = {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
            for name, linear in linears.items():
                pointers = getattr(slot, name)
                lora = layer.self_attn.lora if name in ("qkv", "o") else layer.mlp.lora
                if lora is not None:
                    pointers.lora = ctypes.addressof(lora.projections[name].pointers)
                int8 = _native_int8(linear)
                if int8 is not None:
                    assert int8.packed is not None
                    pointers.set_int8(int8.packed, int8.scale)
                else:
                    assert isinstance(linear, GGUFLinear) and linear.plan is not None
                    pointers.set_gguf(linear.plan)
                    self.plans.append(linear.plan)
            slot.qkv_bias = None if attn.qkv_proj.bias is None else attn.qkv_proj.bias.data_ptr()
            slot.input_norm = layer.input_layernorm.weight.data_ptr()
            slot.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            assert attn.kv_cache is not None
            slot.set_cache(attn.kv_cache)
            slot.q_norm, slot.k_norm, slot.attn_out_norm, slot.mlp_out_norm = (
                None if norm is None else norm.weight.data_ptr()
                for norm in (attn.q_norm, attn.k_norm, layer.attn_output_norm, layer.mlp_output_norm))
            slot.window = attn.window or 0
            slot.local_rope = int(attn.window is not None and model.local_rope is not None)
        self.dims = (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                     config.intermediate_size)
        self.gelu = config.hidden_act == "gelu_tanh"
        self.eps = config.rms_norm_eps
        self.scale = config.softmax_scale
        self.block_size = self.caches[0].k.shape[3]
        self.kv_kind = self.caches[0].format.kind
        self.work = torch.empty(0)  # scratch, grown to the largest batch seen
        self.lora_context = model.lora_context

    @staticmethod
    def supported(model: LlamaForCausalLM) -> bool:
        """Every projection int8 packed for the grouped kernel or GGUF blocks the kernel executes (biases on qkv
        only), the fused layer kernels and the native attention over these caches."""
        if not kernels.decoder_stack_available():
            return False
        for layer in model.decoder_layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if attn.kv_cache is None or not all(_native_int8(x) is not None or (
                    isinstance(x, GGUFLinear) and x.plan is not None) for x in linears):
                return False
            norms = (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm,
                     layer.attn_output_norm, layer.mlp_output_norm)
            if any(x.bias is not None for x in linears[1:]) or any(
                    norm is not None and norm.weight.dtype != torch.float32 for norm in norms):
                return False
            query = torch.empty(1, attn.num_heads, attn.head_dim)
            if not (kernels.layer_ops_supported(query) and kernels.attention_supported(query, attn.num_heads,
                                                                                       attn.kv_cache)):
                return False
        return True

    def __call__(self, x: torch.Tensor, rope: RopeTables, local_rope: RopeTables,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's output, the residual stream) for embeddings x [T, hidden] (updated in place);
        `local_rope`: the tables of the windowed layers with their own base (else `rope` again)."""
        needed = x.shape[0] * kernels.decoder_work_floats(*self.dims)
        if self.work.numel() < needed:
            self.work = torch.empty(needed)
        lora = None if self.lora_context is None else self.lora_context.batch
        out = kernels.decoder_forward(self.pointers, self.dims, self.eps, x, self.work, rope, local_rope,
                                      meta.slot_mapping, self.block_size, meta.query_start, meta.seq_lens,
                                      meta.block_tables, self.scale, self.kv_kind, self.gelu,
                                      None if lora is None else lora.pointers)
        return out, x


def _native_int8(linear: nn.Module) -> Int8Linear | None:
    """The int8 layer packed for the grouped kernel that runs this projection (a GGUF layer's fallback), if any."""
    int8 = linear.fallback if isinstance(linear, GGUFLinear) else linear
    return int8 if isinstance(int8, Int8Linear) and int8.packed is not None else None


def _partial_rotary_order(config: ModelConfig) -> torch.Tensor | None:
    """Partial rotary: the order of the fused q/k/v rows that puts each q and k head's rotated dims at the outer
    parts of its two halves (RotaryEmbedding's layout); None when every dim rotates. Reordering q and k alike
    leaves every q.k product, hence attention, unchanged; v keeps its order."""
    hd, rot = config.head_dim, config.rotary_dim or config.head_dim
    if rot == hd:
        return None
    half, passed = rot // 2, (hd - rot) // 2
    head = torch.cat([torch.arange(half), rot + torch.arange(passed), half + torch.arange(half),
                      rot + passed + torch.arange(passed)])
    rows = [h * hd + head for h in range(config.num_heads + config.num_kv_heads)]
    first_v = (config.num_heads + config.num_kv_heads) * hd
    rows.append(first_v + torch.arange(config.num_kv_heads * hd))
    return torch.cat(rows)


class LlamaForCausalLM(nn.Module):
    """`quantization` is a resolved mode of `model/quant.py` ("none", "bf16", "int8"); it applies to every
    projection and to the LM head. A tied LM head doubles as the embedding table (one copy of the weights).
    `int8_key_scales`: it will run over int8 KV caches, so load_weights derives their key channel scales."""

    def __init__(self, config: ModelConfig, quantization: str = "none", int8_key_scales: bool = False) -> None:
        super().__init__()
        self.config = config
        self.quantization = quantization
        self.int8_key_scales = int8_key_scales
        # uninitialized (load_weights fills it, or swaps in the file's own table: StoredEmbedding)
        self.embed_tokens: nn.Module | None = (
            None if config.tie_word_embeddings else
            nn.Embedding(config.vocab_size, config.hidden_size,
                         _weight=torch.empty(config.vocab_size, config.hidden_size), _freeze=True)
        )
        self.layers = nn.ModuleList(DecoderLayer(config, quantization, config.window_of(i))
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.max_context_len, config.rope_scaling,
                                    config.rotary_dim, config.max_position_embeddings)
        # Gemma 3's windowed layers rotate with their own base, unscaled
        self.local_rope = (None if config.rope_local_theta is None else
                           RotaryEmbedding(config.head_dim, config.rope_local_theta, config.max_context_len,
                                           rotary_dim=config.rotary_dim))
        self.embed_scale = None if config.embed_scale is None else torch.tensor(config.embed_scale)
        self.lm_head = make_linear(quantization, config.hidden_size, config.vocab_size)
        self._stack: NativeDecoderStack | None = None  # set by bind_kv_caches
        self.rotary_order = _partial_rotary_order(config)
        self.lora_context: LoRAContext | None = None  # set by attach_lora


    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return cast(list[DecoderLayer], list(self.layers))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.lm_head.rows(input_ids) if self.embed_tokens is None else self.embed_tokens(input_ids)
        x = x.to(self.norm.weight.dtype)  # a StoredEmbedding decodes float32 whatever the model's dtype
        return x if self.embed_scale is None else x * self.embed_scale.to(x.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                rope_lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] of a flat token batch. `rope_lengths` [T]: the sequence length each token
        is rotated for, max(prompt length, position + 1), read by length-dependent rope scalings (rope.py)."""
        return self.run_layers(self.embed(input_ids), positions, meta, rope_lengths)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                   rope_lengths: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder layers and the final norm over embedded tokens x [T, hidden] (the part of a decode step
        a CUDA graph captures: executor/cuda_graphs.py)."""
        reached = int(meta.seq_lens_np.max()) if len(meta.seq_lens_np) else 0  # the rope tables grow to it
        self.rope.reserve(reached)
        rope = self.rope(positions, rope_lengths)
        local_rope = rope
        if self.local_rope is not None:
            self.local_rope.reserve(reached)
            local_rope = self.local_rope(positions)
        if self._stack is not None and x.device.type == "cpu" and x.dtype == torch.float32:
            out, stream = self._stack(x.contiguous(), rope, local_rope, meta)
            return self.norm(out, stream)[0]
        residual = None
        for layer in self.decoder_layers:
            x, residual = layer(x, residual, rope if layer.self_attn.window is None else local_rope, meta)
        return self.norm(x, residual)[0]

    def attach_lora(self, slots: LoRASlots, context: LoRAContext) -> None:
        """Every projection adds the deltas of the adapters in `slots` for the rows `context.batch` names (before
        bind_kv_caches, so that the native stack adds them too)."""
        self.lora_context = context
        for layer, projections in zip(self.decoder_layers, slots.layers):
            layer.self_attn.lora = layer.mlp.lora = LayerLoRA(projections, context)

    def bind_kv_caches(self, caches: list[kv_quant.LayerKV]) -> None:
        """Give each layer its (K, V) cache; then the one-call decoder stack is set up where it applies."""
        for layer, cache in zip(self.decoder_layers, caches):
            layer.self_attn.kv_cache = cache
            if cache.key_channel_scale is not None:
                cache.key_channel_scale.copy_(layer.self_attn.key_channel_scale)
        self._stack = NativeDecoderStack(self) if NativeDecoderStack.supported(self) else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _key_channel_scales(self, weights: Mapping[str, torch.Tensor], prefix: str,
                            layer: DecoderLayer) -> torch.Tensor:
        """The layer's key channel scales for int8 caches (model/key_smoothing.py), from its query and key
        projections (read again: a lazy file dequantizes those tensors), in the rotary order the model runs."""
        config, attn = self.config, layer.self_attn
        fused = prefix + "self_attn.qkv_proj.weight" in weights
        order = self.rotary_order[:config.head_dim] if self.rotary_order is not None else None
        sizes = []
        for name, heads, rows, norm in (("q", config.num_heads, slice(0, attn.q_size), attn.q_norm),
                                        ("k", config.num_kv_heads, slice(attn.q_size, attn.q_size + attn.kv_size),
                                         attn.k_norm)):
            stem = prefix + ("self_attn.qkv_proj" if fused else f"self_attn.{name}_proj")
            weight = weights[stem + ".weight"]
            bias = weights.get(stem + ".bias") if attn.qkv_proj.bias is not None else None
            if fused:
                weight, bias = weight[rows], None if bias is None else bias[rows]
            if order is not None:
                per_head = torch.cat([h * config.head_dim + order for h in range(heads)])
                weight, bias = weight[per_head], None if bias is None else bias[per_head]
            sizes.append(channel_sizes(weight, bias, layer.input_layernorm.weight.detach(),
                                       None if norm is None else norm.weight.detach(), heads, config.head_dim))
        return key_channel_scales(sizes[1], sizes[0])

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Load HF-named weights one tensor at a time, fusing q/k/v and gate/up.

        `weights` may be lazy (a GGUF file dequantizes each tensor on access): every tensor is read once and
        converted by its layer's backend before the next is read, so at most one float32 tensor is alive.
        """
        taken: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"weight {name!r} missing from the checkpoint")
            taken.add(name)
            return weights[name]

        def load_linear(linear: QuantLinear, names: list[str], bias_names: list[str] | None = None,
                        rows: torch.Tensor | None = None) -> None:
            """The weights `names` stacked by rows (a fused projection), reordered by `rows` if given. An int8
            layer takes them quantized from the file's blocks where the file allows (no float32 copy)."""
            bias = None
            if linear.bias is not None and bias_names:
                bias = torch.cat([take(n) for n in bias_names])
                bias = bias if rows is None else bias[rows]
            lazy = weights if isinstance(weights, LazyWeights) else None
            if isinstance(linear, GGUFLinear) and lazy is not None:  # executed as the file stores them
                stored = [lazy.stored_blocks(n) for n in names]
                if all(s is not None for s in stored) and linear.load_stored(
                        [s for s in stored if s is not None], bias, rows):
                    taken.update(names)
                    return
            int8_rows = None if lazy is None else lazy.int8_rows
            if isinstance(linear, (Int8Linear, GGUFLinear)) and int8_rows is not None:
                parts = [int8_rows(n) for n in names]
                if all(part is not None for part in parts):
                    taken.update(names)
                    q = torch.cat([part[0] for part in parts if part is not None])
                    scale = torch.cat([part[1] for part in parts if part is not None])
                    linear.load_int8(q if rows is None else q[rows], scale if rows is None else scale[rows], bias)
                    return
            weight = torch.cat([take(n) for n in names]) if len(names) > 1 else take(names[0])
            linear.load(weight if rows is None else weight[rows], bias)

        tied = self.embed_tokens is None
        load_linear(self.lm_head, ["model.embed_tokens.weight" if tied else "lm_head.weight"])
        stored = weights.stored_embedding("model.embed_tokens.weight") if isinstance(weights, LazyWeights) else None
        if self.embed_tokens is not None and stored is not None and self.embed_tokens.weight.device.type == "cpu":
            taken.add("model.embed_tokens.weight")
            self.embed_tokens = stored  # read from the file on lookup, never copied
        elif isinstance(self.embed_tokens, nn.Embedding):
            self.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
        self.norm.weight.copy_(take("model.norm.weight"))
        for i, layer in enumerate(self.decoder_layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
            if layer.attn_output_norm is not None and layer.mlp_output_norm is not None:  # Gemma's names
                layer.attn_output_norm.weight.copy_(take(p + "post_attention_layernorm.weight"))
                layer.post_attention_layernorm.weight.copy_(take(p + "pre_feedforward_layernorm.weight"))
                layer.mlp_output_norm.weight.copy_(take(p + "post_feedforward_layernorm.weight"))
            else:
                layer.post_attention_layernorm.weight.copy_(take(p + "post_attention_layernorm.weight"))
            if attn.q_norm is not None and attn.k_norm is not None:
                head_order = slice(None) if self.rotary_order is None else self.rotary_order[:self.config.head_dim]
                attn.q_norm.weight.copy_(take(p + "self_attn.q_norm.weight")[head_order])
                attn.k_norm.weight.copy_(take(p + "self_attn.k_norm.weight")[head_order])
            if p + "self_attn.qkv_proj.weight" in weights:  # stored fused (Phi-3): q, k, v rows in that order
                load_linear(attn.qkv_proj, [p + "self_attn.qkv_proj.weight"], [p + "self_attn.qkv_proj.bias"],
                            self.rotary_order)
            else:
                load_linear(attn.qkv_proj, [p + f"self_attn.{n}_proj.weight" for n in "qkv"],
                            [p + f"self_attn.{n}_proj.bias" for n in "qkv"], self.rotary_order)
            if self.int8_key_scales:  # (reads q and k again: not paid by the other cache formats)
                attn.key_channel_scale = self._key_channel_scales(weights, p, layer)
            load_linear(attn.o_proj, [p + "self_attn.o_proj.weight"])
            if p + "mlp.gate_up_proj.weight" in weights:  # gate rows, then up rows
                load_linear(mlp.gate_up_proj, [p + "mlp.gate_up_proj.weight"])
            else:
                load_linear(mlp.gate_up_proj, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
            load_linear(mlp.down_proj, [p + "mlp.down_proj.weight"])
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if isinstance(linear, (Int8Linear, GGUFLinear)):
                    linear.drop_rows()  # only a tied LM head looks rows up; freed before the next tensor loads
        ignored = {"lm_head.weight"} if tied else set()
        leftovers = [n for n in weights
                     if n not in taken and n not in ignored and not n.endswith("rotary_emb.inv_freq")]
        if leftovers:
            raise ValueError(f"unexpected weights in checkpoint: {leftovers[:5]}")
