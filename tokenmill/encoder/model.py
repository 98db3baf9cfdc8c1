"""The encoder forward pass (BERT and nomic-bert): bidirectional attention over each input, no KV cache, and the
pooling that turns its last hidden states into one vector (or a cross-encoder's score).

A batch is packed: the linear layers and norms run on all inputs' tokens at once ([tokens, hidden], no padding);
attention runs per input over its own tokens. The linear layers are tokenmill's (`model/quant.py`): float32,
bf16 or the int8 kernels, as `--quantization` resolves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.encoder.config import EncoderConfig, Pooling
from tokenmill.encoder.inputs import EncoderInput
from tokenmill.model.linear import BF16Linear, QuantLinear
from tokenmill.model.quant import make_linear


class _LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class EncoderLayer(nn.Module):
    def __init__(self, config: EncoderConfig, quantization: str) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, not config.gated_mlp
        self.config = config
        self.qkv = make_linear(quantization, hidden, 3 * hidden, bias)
        self.out = make_linear(quantization, hidden, hidden, bias)
        self.attn_norm = _LayerNorm(hidden, config.layer_norm_eps)
        # nomic-bert: gate and up fused (one GEMM), silu(gate) * up; BERT: gelu(up)
        self.up = make_linear(quantization, hidden, 2 * inner if config.gated_mlp else inner, bias)
        self.down = make_linear(quantization, inner, hidden, bias)
        self.mlp_norm = _LayerNorm(hidden, config.layer_norm_eps)

    def forward(self, x: torch.Tensor, lengths: Sequence[int], rotary: tuple[torch.Tensor, torch.Tensor] | None
                ) -> torch.Tensor:
        config = self.config
        heads, head_dim = config.num_heads, config.head_dim
        # [3, heads, tokens, head_dim]: each head's rows contiguous, as the fused CPU attention kernel reads them
        q, k, v = self.qkv(x).view(-1, 3, heads, head_dim).permute(1, 2, 0, 3).contiguous().unbind(0)
        if rotary is not None:
            q, k = _rotate(q, *rotary), _rotate(k, *rotary)
        parts = []
        start = 0
        for length in lengths:  # each input attends to its own tokens only (no padding, no mask)
            span = slice(start, start + length)
            parts.append(F.scaled_dot_product_attention(q[None, :, span], k[None, :, span], v[None, :, span])[0])
            start += length
        attended = torch.cat(parts, dim=1).transpose(0, 1).reshape(-1, heads * head_dim)
        x = self.attn_norm(x + self.out(attended))
        return self.mlp_norm(x + self._mlp(x))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        up, down = self.up, self.down
        if isinstance(up, BF16Linear) and isinstance(down, BF16Linear):
            # bf16 linears: the intermediate (the widest activation) stays in bf16 from one GEMM to the next;
            # the down GEMM would round it to bf16 anyway, and float32 round trips cost 10% of a batch here
            inner = F.linear(x.to(torch.bfloat16), up.weight, None if up.bias is None else up.bias.bfloat16())
            return F.linear(self._activate(inner), down.weight).float() + (0 if down.bias is None else down.bias)
        return down(self._activate(up(x)))

    def _activate(self, inner: torch.Tensor) -> torch.Tensor:
        if self.config.gated_mlp:
            gate, up = inner.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(inner)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions, the halves of each head rotated together (GPT-NeoX style, as nomic-bert and
    llama.cpp's NEOX rope): x [heads, tokens, head_dim], cos/sin [tokens, head_dim / 2]."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


class EncoderModel(nn.Module):
    def __init__(self, config: EncoderConfig, quantization: str = "none") -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.word = nn.Embedding(config.vocab_size, hidden)
        self.position = None if config.rope_theta is not None else nn.Embedding(config.max_position_embeddings,
                                                                                  hidden)
        self.token_type = nn.Embedding(config.type_vocab_size, hidden)
        self.embed_norm = _LayerNorm(hidden, config.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(config, quantization) for _ in range(config.num_layers))
        # a cross-encoder: tanh(pooler(cls state)) -> classifier logits, in float32 (small)
        self.pooler: nn.Linear | None = None
        self.classifier: nn.Linear | None = None
        if config.is_cross_encoder:
            self.pooler = nn.Linear(hidden, hidden)
            self.classifier = nn.Linear(hidden, config.num_labels)
        if config.rope_theta is not None:
            exponents = torch.arange(0, config.head_dim // 2, dtype=torch.float32) * 2 / config.head_dim
            inv_freq: torch.Tensor = 1.0 / config.rope_theta**exponents
            self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.requires_grad_(False)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Take `weights` (encoder/weights.py's names; consumed as read)."""

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"the encoder checkpoint lacks {name!r}")
            return weights.pop(name)

        def optional(name: str) -> torch.Tensor | None:
            return weights.pop(name, None)

        self.word.weight.data = take("word.weight")
        if self.position is not None:
            self.position.weight.data = take("position.weight")
        token_type = optional("token_type.weight")
        self.token_type.weight.data = (token_type if token_type is not None
                                       else torch.zeros_like(self.token_type.weight))
        self.embed_norm.weight.data, self.embed_norm.bias.data = take("embed_norm.weight"), take("embed_norm.bias")
        for i, module in enumerate(self.layers):
            layer = cast(EncoderLayer, module)
            prefix = f"layers.{i}."

            def linear(target: QuantLinear, *names: str, prefix: str = prefix) -> None:
                weight = torch.cat([take(f"{prefix}{n}.weight") for n in names])
                biases = [optional(f"{prefix}{n}.bias") for n in names]
                target.load(weight, None if biases[0] is None else torch.cat([b for b in biases if b is not None]))

            if f"{prefix}qkv.weight" in weights:
                linear(layer.qkv, "qkv")
            else:
                linear(layer.qkv, "q", "k", "v")
            linear(layer.out, "out")
            linear(layer.up, *(("gate", "up") if self.config.gated_mlp else ("up",)))
            linear(layer.down, "down")
            for norm_name in ("attn_norm", "mlp_norm"):
                norm = getattr(layer, norm_name)
                norm.weight.data = take(f"{prefix}{norm_name}.weight")
                norm.bias.data = take(f"{prefix}{norm_name}.bias")
        if self.pooler is not None and self.classifier is not None:
            self.pooler.weight.data, self.pooler.bias.data = take("pooler.weight"), take("pooler.bias")
            self.classifier.weight.data = take("classifier.weight")
            self.classifier.bias.data = take("classifier.bias")
        for name in ("pooler.weight", "pooler.bias"):  # BERT's next-sentence pooler: embeddings do not use it
            weights.pop(name, None)
        if weights:
            raise ValueError(f"unused tensors in the encoder checkpoint: {sorted(weights)[:8]}")

    def forward(self, inputs: Sequence[EncoderInput]) -> torch.Tensor:
        """Last hidden states of every token, the inputs' tokens one after another: [sum of lengths, hidden]."""
        lengths = [len(i.token_ids) for i in inputs]
        ids = torch.tensor([t for i in inputs for t in i.token_ids], dtype=torch.long)
        types = torch.tensor([t for i in inputs for t in (i.token_type_ids or [0] * len(i.token_ids))],
                             dtype=torch.long)
        positions = torch.cat([torch.arange(n) for n in lengths])
        x = self.word(ids) + self.token_type(types)
        rotary = None
        if self.position is not None:
            x = x + self.position(positions)
        else:
            inv_freq = cast(torch.Tensor, self.inv_freq)
            angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
            rotary = (angles.cos(), angles.sin())
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, lengths, rotary)
        return x

    def pool(self, hidden: torch.Tensor, lengths: Sequence[int], pooling: Pooling) -> torch.Tensor:
        """One vector per input: [inputs, hidden]."""
        starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
        if pooling == "cls":
            return hidden[starts]
        if pooling == "last":
            return hidden[starts + torch.tensor(lengths) - 1]
        return torch.stack([part.mean(0) for part in hidden.split(list(lengths))])

    def classify(self, cls_states: torch.Tensor) -> torch.Tensor:
        """A cross-encoder's logits [inputs, labels] from the CLS states."""
        assert self.pooler is not None and self.classifier is not None
        return self.classifier(torch.tanh(self.pooler(cls_states)))
