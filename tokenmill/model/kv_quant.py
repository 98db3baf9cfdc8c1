"""KV cache element formats: float (float32, bfloat16, float16) and 8-bit (int8, fp8 e4m3, fp8 e5m2).

An 8-bit cache keeps, beside each layer's K and V value tensors (model/attention.py's layouts, one byte an
element), a scale per token and KV head ([blocks, kv_heads, block] bfloat16): when a token is written, each of its
heads' K (and V) vector is divided by `amax / qmax` and rounded to the format (int8: to nearest even, within
+-127; fp8: the nearest value of the format, as torch converts). The scale itself is rounded up to bfloat16, so
no value exceeds the format's range and the stored scale is exact. 8 bits a value plus 16 a head-vector: 8.25
bits a value at head_dim 64 (llama.cpp's q8_0: 8.5).

In int8, keys are stored divided by a power of two per KV head and channel, `key_channel_scale`
(model/key_smoothing.py: outlier channels would otherwise set every token's scale), and queries are multiplied by
it before attention. fp8 keeps a few bits of every channel's own size (a float format), so it does without.

The native kernels (kernels/layer_ops.c: quantize while writing; paged_attention.c: dequantize in registers)
and the torch paths here compute the same values: `quantize` is the reference both follow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVFormat:
    name: str  # --kv-cache-dtype, resolved ("fp8" is fp8_e4m3)
    storage: torch.dtype  # element type of the K and V tensors
    kind: int  # the native kernels' code: 0 float32, 1 bfloat16, 2 int8, 3 fp8 e4m3, 4 fp8 e5m2, -1 none
    qmax: float = 0.0  # 8-bit formats: the largest magnitude a stored value holds; 0: stored unscaled

    @property
    def scaled(self) -> bool:
        return self.qmax > 0

    @property
    def value_bytes(self) -> int:
        return torch.tensor([], dtype=self.storage).element_size()

    def bytes_per_token_head(self, head_dim: int) -> int:
        """Bytes one token's K (or V) of one KV head takes: its values, and its scale in an 8-bit format."""
        return head_dim * self.value_bytes + (SCALE_DTYPE.itemsize if self.scaled else 0)


SCALE_DTYPE = torch.bfloat16
KV_FORMATS: dict[str, KVFormat] = {
    "float32": KVFormat("float32", torch.float32, 0),
    "bfloat16": KVFormat("bfloat16", torch.bfloat16, 1),
    "float16": KVFormat("float16", torch.float16, -1),
    "int8": KVFormat("int8", torch.int8, 2, 127.0),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 3, 448.0),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, 4, 57344.0),
}
KV_FORMATS["fp8"] = KV_FORMATS["fp8_e4m3"]  # vLLM's fp8 is e4m3


def kv_format(name: str) -> KVFormat:
    try:
        return KV_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown KV cache dtype {name!r}; choices: {', '.join(KV_FORMATS)}") from None


_BY_STORAGE = {f.storage: f for f in KV_FORMATS.values()}


def format_of(cache: torch.Tensor) -> KVFormat:
    """The format of a K or V value tensor (its dtype names it)."""
    return _BY_STORAGE[cache.dtype]


@dataclass
class LayerKV:
    """One layer's paged KV cache: K [blocks, kv_heads, head_dim, block] and V [blocks, kv_heads, block,
    head_dim] values, and for 8-bit formats their scales [blocks, kv_heads, block]; for int8 also the keys' channel
    scales [kv_heads, head_dim] float32 (the model sets them when it binds the cache). Absent ones are None."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    key_channel_scale: torch.Tensor | None = None

    @property
    def format(self) -> KVFormat:
        return format_of(self.k)

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the layer indexed by block first (what a KV transfer moves; the channel scales are the
        model's)."""
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    @property
    def block_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors)


def round_up_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the smallest bfloat16 >= x (x >= 0, finite), as float32."""
    return ((x.view(torch.int32) + 0xFFFF) & ~0xFFFF).view(torch.float32)


def quantize(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] float32 -> (values [..., head_dim] in fmt.storage, scales [...] bfloat16), a scale per
    vector. The reference the native write follows: scale = amax / qmax rounded up to bfloat16, values
    x * (1 / scale) rounded to the format."""
    x = x.float()
    scale = round_up_bf16(x.abs().amax(dim=-1) / fmt.qmax)
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    scaled = x * inverse[..., None]
    if fmt.storage == torch.int8:
        values = scaled.round().clamp(-fmt.qmax, fmt.qmax).to(torch.int8)
    else:
        values = scaled.clamp(-fmt.qmax, fmt.qmax).to(fmt.storage)
    return values, scale.to(SCALE_DTYPE)


def dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 values * scales (scales broadcast against values: the caller unsqueezes the shared axis)."""
    return values.to(torch.float32) * scales.to(torch.float32)


def smooth_keys(q: torch.Tensor, k: torch.Tensor, cache: LayerKV) -> tuple[torch.Tensor, torch.Tensor]:
    """(q * s, k / s) for q [T, heads, head_dim] and k [T, kv_heads, head_dim] after RoPE, s the cache's key
    channel scales (unchanged without them): what the native and Triton writes do before storing k."""
    s = cache.key_channel_scale
    if s is None:
        return q, k
    group = q.shape[1] // k.shape[1]
    return q * s.repeat_interleave(group, 0).to(q.dtype), k / s.to(k.dtype)


def write(cache: LayerKV, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V ([T, kv_heads, head_dim]) at their slots, quantized in an 8-bit format."""
    block_size = cache.v.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    fmt = cache.format
    if fmt.scaled:
        assert cache.k_scale is not None and cache.v_scale is not None
        k, k_scale = quantize(k, fmt)
        v, v_scale = quantize(v, fmt)
        cache.k_scale[blocks, :, offsets] = k_scale
        cache.v_scale[blocks, :, offsets] = v_scale
    cache.k[blocks, :, :, offsets] = k.to(cache.k.dtype)
    cache.v[blocks, :, offsets, :] = v.to(cache.v.dtype)


def gather(cache: LayerKV, block_tables: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of whole blocks, [B, kv_heads, blocks * block_size, head_dim] for block_tables [B, blocks],
    in `dtype` (the queries'; a narrower cache widens, an 8-bit one is dequantized)."""
    bsz, num_blocks = block_tables.shape
    _, num_kv_heads, head_dim, block_size = cache.k.shape
    keys = cache.k[block_tables].permute(0, 2, 1, 4, 3)  # [B, kvh, blocks, block, hd]
    values = cache.v[block_tables].transpose(1, 2)  # [B, kvh, blocks, block, hd]
    if cache.k_scale is not None and cache.v_scale is not None:
        keys = dequantize(keys, cache.k_scale[block_tables].transpose(1, 2)[..., None])
        values = dequantize(values, cache.v_scale[block_tables].transpose(1, 2)[..., None])
    shape = (bsz, num_kv_heads, num_blocks * block_size, head_dim)
    return keys.reshape(shape).to(dtype), values.reshape(shape).to(dtype)
