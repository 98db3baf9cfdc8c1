"""Native CPU kernels: small C files compiled at first use for this machine, loaded with ctypes.

Plain C with no Python or torch headers compiles in about a second with the system's gcc (torch's
`cpp_extension` would take a minute on two cores). The shared library is cached per source, compiler flags
and CPU (`~/.cache/tokenmill/kernels`, or `$TOKENMILL_CACHE_DIR`). Where no compiler is available the callers
fall back to their pure-torch paths, so the kernels are a speed-up, never a requirement.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from tokenmill.isa import compiler_flags, cpu_level
from tokenmill.model.kv_quant import LayerKV
from tokenmill.platform import cache_root, cpu_flags, isa_level, raw_cpu_flags

logger = logging.getLogger(__name__)
_SOURCE_DIR = Path(__file__).parent


@functools.cache
def build_flags() -> list[str]:
    """No -ffast-math and no implicit FMA contraction: the kernels promise the same float operations for a row
    whatever its batch (see paged_attention.c). The target: this CPU, or the TOKENMILL_ISA level below it."""
    return ["-O3", *compiler_flags(isa_level(), raw_cpu_flags()), "-ffp-contract=off", "-fopenmp", "-shared",
            "-fPIC", "-std=c11"]


# Limits compiled into paged_attention.c (stack arrays).
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 64, 256, 64


def cache_dir() -> Path:
    return cache_root() / "kernels"


@functools.cache
def load_library(name: str) -> ctypes.CDLL | None:
    """Compile (once per machine) and load `<name>.c`; None when that is impossible here."""
    if os.environ.get("TOKENMILL_DISABLE_KERNELS"):
        return None
    source = _SOURCE_DIR / f"{name}.c"
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.warning("no C compiler found: native kernel %s disabled, using the torch fallback", name)
        return None
    # every source here: headers are shared (vec_exp.h) and decoder.c includes the other kernels
    sources = b"".join(f.read_bytes() for f in sorted([*_SOURCE_DIR.glob("*.c"), *_SOURCE_DIR.glob("*.h")]))
    key = hashlib.sha256(name.encode() + sources + " ".join(build_flags()).encode()
                         + " ".join(sorted(cpu_flags())).encode())
    target = cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run([compiler, *build_flags(), str(source), "-o", str(built), "-lm"],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                logger.warning("building native kernel %s failed, using the torch fallback:\n%s", name,
                               result.stderr[-2000:])
                return None
            os.replace(built, target)  # atomic: concurrent processes never load a half-written file
    # `import torch` has loaded torch's libgomp.so.1; the kernel's dependency on that soname resolves to it.
    return ctypes.CDLL(str(target))


def _function(library: str, name: str, argtypes: list[type]) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    lib = load_library(library)
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.argtypes = argtypes
    fn.restype = None
    return fn


_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


@functools.cache
def _quantize_fn() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return _function("int8_rows", "quantize_two_level", [_PTR, _I64, _I64, _I64, _PTR, _PTR])


@functools.cache
def _dequantize_fn() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return _function("int8_rows", "dequantize_two_level", [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR])


@functools.cache
def _grouped_fns() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | None:  # type: ignore[name-defined]
    lib = load_library("int8_rows")
    if lib is None or not lib.int8_grouped_available():
        return None
    quantize = _function("int8_rows", "quantize_groups", [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR])
    linear = _function("int8_rows", "int8_linear_grouped", [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _I64])
    assert quantize is not None and linear is not None
    return quantize, linear


@functools.cache
def _pack_fns() -> tuple[int, ctypes._CFuncPtr]:  # type: ignore[name-defined]
    """(outputs per packed vector of this CPU's grouped kernel: 16 for AVX512-VNNI, 8 for AVX2; int8_pack)."""
    lib = load_library("int8_rows")
    pack = _function("int8_rows", "int8_pack", [_PTR, _I64, _I64, _PTR])
    assert lib is not None and pack is not None
    return int(lib.int8_pack_lanes()), pack


INT8_GROUP = 32  # activations share one int8 scale per row and 32 consecutive input features (int8_rows.c)


def int8_grouped_available() -> bool:
    """Whether this CPU runs the grouped-activation int8 kernel (AVX512-VNNI, or AVX2 with FMA)."""
    return _grouped_fns() is not None


def pack_vnni(weight: torch.Tensor) -> torch.Tensor:
    """int8 weight [n, k] (k a multiple of 4) -> packed [ceil(n/L), k/4, L, 4], the layout `int8_linear_grouped`
    reads (int8_rows.c): L outputs per vector, four consecutive k each; on VNNI hosts (L = 16) the bytes hold
    w + 128 as unsigned."""
    lanes, pack = _pack_fns()
    n, k = weight.shape
    if k % 4:
        raise ValueError(f"packing needs in_features a multiple of 4, got {k}")
    weight = weight.contiguous()
    out = torch.empty(-(-n // lanes), k // 4, lanes, 4, dtype=torch.int8)
    pack(weight.data_ptr(), n, k, out.data_ptr())
    return out


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, k] float32 (k a multiple of 32, rows contiguous) -> (q [rows, k] int8, scales [rows, k/32],
    corr [rows, k/32] int32 = 128 * each group's sum of q)."""
    fns = _grouped_fns()
    assert fns is not None and x.dtype == torch.float32 and x.stride(1) == 1 and x.shape[1] % INT8_GROUP == 0
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.int8)
    scales = torch.empty(rows, k // INT8_GROUP)
    corr = torch.empty(rows, k // INT8_GROUP, dtype=torch.int32)
    fns[0](x.data_ptr(), rows, k, x.stride(0), q.data_ptr(), scales.data_ptr(), corr.data_ptr())
    return q, scales, corr


def int8_linear_grouped(x: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                        n: int) -> torch.Tensor:
    """The int8 linear for x [rows, k] float32 (rows contiguous, k a multiple of 32) in one native call:
    activations quantized per group of 32, exact int32 group sums, float accumulation over the groups."""
    fns = _grouped_fns()
    assert fns is not None and x.dtype == torch.float32 and x.stride(1) == 1 and packed.shape[1] * 4 == x.shape[1]
    assert x.shape[1] % INT8_GROUP == 0
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    fns[1](x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), packed.data_ptr(), weight_scale.data_ptr(),
           None if bias is None else bias.data_ptr(), out.data_ptr(), n)
    return out


class _LayerFns(NamedTuple):
    add_rms_norm: ctypes._CFuncPtr  # type: ignore[name-defined]
    rope_and_cache: ctypes._CFuncPtr  # type: ignore[name-defined]
    silu_and_mul: ctypes._CFuncPtr  # type: ignore[name-defined]
    gelu_tanh_and_mul: ctypes._CFuncPtr  # type: ignore[name-defined]
    rms_norm_heads: ctypes._CFuncPtr  # type: ignore[name-defined]


@functools.cache
def _layer_fns() -> _LayerFns | None:
    fns = (
        _function("layer_ops", "add_rms_norm", [_PTR, _PTR, _I64, _PTR, _F32, _PTR, _I64, _I64]),
        _function("layer_ops", "rope_and_cache", [_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64,
                                                  _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64]),
        _function("layer_ops", "silu_and_mul", [_PTR, _I64, _I64, _PTR]),
        _function("layer_ops", "gelu_tanh_and_mul", [_PTR, _I64, _I64, _PTR]),
        _function("layer_ops", "rms_norm_heads", [_PTR, _I64, _I64, _I64, _I64, _PTR, _F32]),
    )
    return None if any(fn is None for fn in fns) else _LayerFns(*fns)


def layer_ops_supported(x: torch.Tensor) -> bool:
    """Whether the fused layer kernels take x (float32 on CPU) on this machine."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and _layer_fns() is not None


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += delta (in place, when given); returns RMSNorm(residual) * weight. [rows, cols] float32."""
    fns = _layer_fns()
    assert fns is not None and residual.is_contiguous() and weight.is_contiguous()
    rows, cols = residual.shape
    if delta is not None:
        assert delta.shape == residual.shape and delta.stride(1) == 1
    out = torch.empty_like(residual)
    fns.add_rms_norm(residual.data_ptr(), None if delta is None else delta.data_ptr(),
                     0 if delta is None else delta.stride(0), weight.data_ptr(), eps, out.data_ptr(), rows, cols)
    return out


def rms_norm_heads(x: torch.Tensor, heads: int, weight: torch.Tensor, eps: float) -> None:
    """QK-norm in place: the first `heads` heads of every row of x [T, >= heads * head_dim] (the q or k part of
    the fused projection, a view with unit column stride) each through RMSNorm * weight [head_dim]."""
    fns = _layer_fns()
    head_dim = weight.shape[0]
    assert fns is not None and x.dtype == torch.float32 and x.stride(1) == 1 and weight.is_contiguous()
    assert x.shape[1] >= heads * head_dim
    fns.rms_norm_heads(x.data_ptr(), x.stride(0), x.shape[0], heads, head_dim, weight.data_ptr(), eps)


def rope_and_cache(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                   slot_mapping: torch.Tensor, cache: LayerKV) -> torch.Tensor:
    """RoPE on q and k of the fused projection [T, (heads + 2 kv_heads) * head_dim]; k and v go to their cache
    slots (quantized as they are written in an 8-bit format, keys divided by the cache's channel scales); returns
    q [T, heads, head_dim] (times those scales). cos, sin: [T, head_dim] rows of this step's positions."""
    fns = _layer_fns()
    tokens, head_dim = qkv.shape[0], cos.shape[-1]
    assert fns is not None and qkv.stride(1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    assert slot_mapping.dtype == torch.int64 and head_dim <= MAX_HEAD_DIM
    q = torch.empty(tokens, num_heads, head_dim)
    *pointers, kind = cache_pointers(cache)
    fns.rope_and_cache(qkv.data_ptr(), qkv.stride(0), tokens, num_heads, num_kv_heads, head_dim, cos.data_ptr(),
                       sin.data_ptr(), slot_mapping.data_ptr(), cache.k.shape[3], *pointers,
                       key_channel_pointer(cache), q.data_ptr(), kind)
    return q


def gated_activation(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """act(gate) * up for gate_up [rows, 2n] (gate first, contiguous) -> [rows, n]: SiLU (SwiGLU) or, with
    `gelu`, GELU's tanh approximation (GeGLU)."""
    fns = _layer_fns()
    assert fns is not None and gate_up.is_contiguous()
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n)
    (fns.gelu_tanh_and_mul if gelu else fns.silu_and_mul)(gate_up.data_ptr(), rows, n, out.data_ptr())
    return out


@functools.cache
def _bitmask_fn() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return _function("token_bitmask", "apply_token_bitmask", [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64])


def token_bitmask_supported(logits: torch.Tensor) -> bool:
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and _bitmask_fn() is not None)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask row i is clear (token_bitmask.c)."""
    fn = _bitmask_fn()
    assert fn is not None
    rows = rows.to(torch.int64).contiguous()
    bitmask = bitmask.contiguous()
    fn(logits.data_ptr(), logits.stride(0), rows.data_ptr(), rows.numel(), bitmask.data_ptr(), bitmask.shape[1],
       logits.shape[1])


@functools.cache
def _gguf_fns() -> tuple[ctypes._CFuncPtr, ...] | None:  # type: ignore[name-defined]
    lib = load_library("gguf_blocks")
    if lib is None:
        return None
    row_bytes = lib.gguf_row_bytes
    row_bytes.argtypes, row_bytes.restype = [ctypes.c_int, _I64], _I64
    dequantize = _function("gguf_blocks", "gguf_dequantize", [ctypes.c_int, _PTR, _I64, _I64, _PTR])
    to_int8 = _function("gguf_blocks", "gguf_quantize_int8", [ctypes.c_int, _PTR, _I64, _I64, _PTR, _PTR])
    gather = _function("gguf_blocks", "gguf_gather_rows", [ctypes.c_int, _PTR, _I64, _PTR, _I64, _PTR])
    assert dequantize is not None and to_int8 is not None and gather is not None
    return row_bytes, dequantize, to_int8, gather


def gguf_decodable(tensor_type: int, cols: int) -> bool:
    """Whether gguf_blocks.c decodes rows of `cols` values of this GGML type (F32/F16/BF16, Q4_0-Q8_0 and
    the k-quants Q2_K-Q6_K)."""
    fns = _gguf_fns()
    return fns is not None and fns[0](tensor_type, cols) > 0


def _gguf_source(data: np.ndarray, tensor_type: int, rows: int, cols: int) -> int:
    fns = _gguf_fns()
    assert fns is not None
    if data.nbytes != rows * fns[0](tensor_type, cols) or not data.flags.c_contiguous:
        raise ValueError(f"GGUF tensor data of {data.nbytes} bytes is not {rows} rows of {cols} values")
    return int(data.ctypes.data)


def gguf_dequantize(data: np.ndarray, tensor_type: int, rows: int, cols: int) -> torch.Tensor:
    """The float32 [rows, cols] of a GGUF tensor's bytes (a view into the file's map), bit-identical to the
    `gguf` package's numpy dequantization."""
    out = torch.empty(rows, cols, dtype=torch.float32)
    fns = _gguf_fns()
    assert fns is not None
    fns[1](tensor_type, _gguf_source(data, tensor_type, rows, cols), rows, cols, out.data_ptr())
    return out


def gguf_to_int8_rows(data: np.ndarray, tensor_type: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [rows, cols], scale [rows]) of a GGUF tensor's bytes, as int8_linear.quantize_rows of its float32
    dequantization, without making that float32 copy."""
    q = torch.empty(rows, cols, dtype=torch.int8)
    scale = torch.empty(rows, dtype=torch.float32)
    fns = _gguf_fns()
    assert fns is not None
    fns[2](tensor_type, _gguf_source(data, tensor_type, rows, cols), rows, cols, q.data_ptr(), scale.data_ptr())
    return q, scale


def gguf_gather_rows(data: np.ndarray, tensor_type: int, rows: int, cols: int, index: torch.Tensor) -> torch.Tensor:
    """float32 [len(index), cols]: the rows `index` of a GGUF tensor, decoded from its bytes."""
    fns = _gguf_fns()
    assert fns is not None
    index = index.to(torch.int64).contiguous()
    if index.numel() and not 0 <= int(index.min()) <= int(index.max()) < rows:
        raise IndexError(f"row index out of range [0, {rows})")
    out = torch.empty(index.numel(), cols, dtype=torch.float32)
    fns[3](tensor_type, _gguf_source(data, tensor_type, rows, cols), cols, index.data_ptr(), index.numel(),
           out.data_ptr())
    return out


@functools.cache
def _gguf_matmul_fns() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | None:  # type: ignore[name-defined]
    lib = load_library("gguf_matmul")
    if lib is None or not lib.gguf_matmul_available() or _grouped_fns() is None:
        return None
    supports = lib.gguf_matmul_supports
    supports.argtypes, supports.restype = [ctypes.c_int], ctypes.c_int
    matmul = _function("gguf_matmul", "gguf_matmul", [_I64, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64,
                                                      _PTR, _PTR, _I64])
    assert matmul is not None
    return supports, matmul


def gguf_matmul_supported(tensor_type: int, cols: int) -> bool:
    """Whether gguf_matmul.c executes rows of `cols` values of this GGML type as stored (AVX2 hosts)."""
    fns = _gguf_matmul_fns()
    return fns is not None and bool(fns[0](tensor_type)) and gguf_decodable(tensor_type, cols)


@functools.cache
def _gguf_panel_fns() -> tuple[ctypes._CFuncPtr, ...] | None:  # type: ignore[name-defined]
    lib = load_library("gguf_panels")
    if lib is None or not lib.gguf_panels_available() or _grouped_fns() is None:
        return None
    supports, panel_bytes = lib.gguf_panels_supports, lib.gguf_panel_bytes
    supports.argtypes, supports.restype = [ctypes.c_int], ctypes.c_int
    panel_bytes.argtypes, panel_bytes.restype = [ctypes.c_int, _I64], _I64
    pack = _function("gguf_panels", "gguf_panels_pack", [ctypes.c_int, _PTR, _I64, _I64, _PTR, _PTR])
    matmul = _function("gguf_panels", "gguf_panels_matmul", [_I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64,
                                                             _PTR, _PTR, _I64])
    assert pack is not None and matmul is not None
    return supports, panel_bytes, pack, matmul


def gguf_panels_available() -> bool:
    """Whether GGUF weights are repacked into 16-row panels here (kernels/gguf_panels.c: AVX512-VNNI or AVX2)."""
    return _gguf_panel_fns() is not None


def _panel_bytes(tensor_type: int, cols: int) -> int:
    fns = _gguf_panel_fns()
    return 0 if fns is None or not fns[0](tensor_type) else int(fns[1](tensor_type, cols))


class GGUFMatmulPlan:
    """The stacked GGUF tensors of one linear layer, as the kernels read them (built once, at load): on
    AVX512-VNNI and AVX2 hosts repacked into 16-row panels (gguf_panels.c; the file's bytes are then no longer
    read), else the file's blocks in place (gguf_matmul.c). A step then costs one quantize_groups call and one
    kernel call."""

    def __init__(self, parts: list[tuple[np.ndarray, int, int, torch.Tensor | None]], cols: int,
                 panels: bool | None = None) -> None:
        """parts: (bytes [rows, row bytes], GGML type, rows, row_index (int64) or None), stacked in order;
        panels: repack (None: wherever this host has the panel kernel and every part's type has one)."""
        count = len(parts)
        for data, tensor_type, rows, order in parts:
            _gguf_source(data, tensor_type, rows, cols)  # checks the bytes
            if order is not None:
                assert order.dtype == torch.int64 and order.is_contiguous() and order.numel() == rows
        packable = all(_panel_bytes(t, cols) > 0 for _, t, _, _ in parts)
        if panels and not packable:
            raise ValueError("these GGUF tensors cannot be repacked into panels on this host")
        self.panels = packable if panels is None else panels
        self.cols, self.outputs = cols, sum(rows for _, _, rows, _ in parts)
        self.packed: list[np.ndarray] = []  # the panels (repacked plans)
        self._keep: list[tuple[np.ndarray, torch.Tensor | None]] = []  # the file's arrays (in-place plans)
        if self.panels:
            fns = _gguf_panel_fns()
            assert fns is not None
            for data, tensor_type, rows, order in parts:
                packed = np.empty(-(-rows // 16) * _panel_bytes(tensor_type, cols), dtype=np.uint8)
                fns[2](tensor_type, data.ctypes.data, rows, cols, None if order is None else order.data_ptr(),
                       packed.ctypes.data)
                self.packed.append(packed)
            addresses = [int(a.ctypes.data) for a in self.packed]
            row_index = [0] * count
        else:
            self._keep = [(data, order) for data, _, _, order in parts]
            addresses = [int(d.ctypes.data) for d, _, _, _ in parts]
            row_index = [0 if o is None else o.data_ptr() for _, _, _, o in parts]
        self.types = (ctypes.c_int * count)(*(t for _, t, _, _ in parts))
        self.weights = (ctypes.c_void_p * count)(*addresses)
        self.rows = (ctypes.c_int64 * count)(*(r for _, _, r, _ in parts))
        self.row_index = (ctypes.c_void_p * count)(*row_index)
        self.count = count

    @property
    def nbytes(self) -> int:
        """Bytes of the panels this plan holds (0 where it reads the file's blocks in place)."""
        return sum(a.nbytes for a in self.packed)


def gguf_matmul(x: torch.Tensor, plan: GGUFMatmulPlan, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [tokens, k] float32 @ W.T, W the plan's stacked GGUF tensors executed as stored: activations quantized
    per group of 32 (quantize_groups), integer dots per block (kernels/gguf_panels.c or gguf_matmul.c)."""
    assert x.shape[1] == plan.cols and x.is_contiguous()
    q, scales, corr = quantize_groups(x)
    out = torch.empty(x.shape[0], plan.outputs, dtype=torch.float32)
    args = (q.data_ptr(), scales.data_ptr(), corr.data_ptr(), x.shape[0], 0 if bias is None else bias.data_ptr(),
            out.data_ptr(), out.stride(0))
    if plan.panels:
        panel_fns = _gguf_panel_fns()
        assert panel_fns is not None
        panel_fns[3](plan.count, plan.types, plan.weights, plan.rows, plan.cols, *args)
    else:
        fns = _gguf_matmul_fns()
        assert fns is not None
        fns[1](plan.count, plan.types, plan.weights, plan.rows, plan.row_index, plan.cols, *args)
    return out


def prepare() -> str:
    """Build every kernel now (at start-up, not in the first request's step); returns a line for the log."""
    ready = {
        "attention": native_attention_available(),
        "int8 rows": int8_rows_available(),
        "grouped int8 GEMM": int8_grouped_available(),
        "layer ops": _layer_fns() is not None,
        "token bitmask": _bitmask_fn() is not None,
        "decoder stack": _decoder_fn() is not None,
        "GGUF block decoding": _gguf_fns() is not None,
        "GGUF panels": gguf_panels_available(),
    }
    level = isa_level()
    target = f"{level} (TOKENMILL_ISA)" if level else "this CPU's own: " + cpu_level(raw_cpu_flags())
    return (f"native CPU kernels for {target}: "
            + ", ".join(f"{name} {'on' if on else 'off'}" for name, on in ready.items()))


def int8_rows_available() -> bool:
    return _quantize_fn() is not None and _dequantize_fn() is not None


def quantize_two_level(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] float32 (rows contiguous) -> (q [2 * rows, cols] int8, scales [2 * rows] float32)."""
    fn = _quantize_fn()
    assert fn is not None and x.dtype == torch.float32 and x.stride(1) == 1
    rows, cols = x.shape
    q = torch.empty(2 * rows, cols, dtype=torch.int8)
    scales = torch.empty(2 * rows, dtype=torch.float32)
    fn(x.data_ptr(), rows, cols, x.stride(0), q.data_ptr(), scales.data_ptr())
    return q, scales


def dequantize_two_level(acc: torch.Tensor, scales: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """acc [2 * rows, n] int32 of both levels -> float32 [rows, n] (see int8_rows.c)."""
    fn = _dequantize_fn()
    assert fn is not None and acc.is_contiguous() and acc.dtype == torch.int32
    rows, n = acc.shape[0] // 2, acc.shape[1]
    out = torch.empty(rows, n, dtype=torch.float32)
    fn(acc.data_ptr(), rows, n, scales.data_ptr(), weight_scale.data_ptr(),
       None if bias is None else bias.data_ptr(), out.data_ptr())
    return out


class LinearPointers(ctypes.Structure):
    """One projection for `decoder_forward` (kernels/decoder.c: Linear): int8 weights packed for the grouped
    kernel and their scales, or (packed NULL) a GGUFMatmulPlan's arrays."""

    _fields_ = [("packed", _PTR), ("scale", _PTR), ("parts", _I64), ("types", _PTR), ("weights", _PTR),
                ("rows", _PTR), ("row_index", _PTR), ("panels", _I64), ("lora", _PTR)]

    def set_int8(self, packed: torch.Tensor, scale: torch.Tensor) -> None:
        self.packed, self.scale = packed.data_ptr(), scale.data_ptr()

    def set_gguf(self, plan: GGUFMatmulPlan) -> None:
        self.parts, self.panels = plan.count, int(plan.panels)
        self.types, self.weights, self.rows, self.row_index = (
            ctypes.addressof(a) for a in (plan.types, plan.weights, plan.rows, plan.row_index))


class DecoderLayerPointers(ctypes.Structure):
    """One layer's tensors for `decoder_forward` (kernels/decoder.c: DecoderLayer), as raw addresses."""

    _fields_ = [("input_norm", _PTR), ("post_norm", _PTR), *((name, LinearPointers) for name in
                ("qkv", "o", "gate_up", "down")), ("qkv_bias", _PTR), ("k_cache", _PTR), ("v_cache", _PTR),
                ("k_scale", _PTR), ("v_scale", _PTR), ("k_channel", _PTR), ("q_norm", _PTR), ("k_norm", _PTR),
                ("attn_out_norm", _PTR), ("mlp_out_norm", _PTR), ("window", _I64), ("local_rope", _I64)]

    def set_cache(self, cache: LayerKV) -> None:
        self.k_cache, self.v_cache, self.k_scale, self.v_scale, _ = cache_pointers(cache)
        self.k_channel = key_channel_pointer(cache)


@functools.cache
def _decoder_fn() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    lib = load_library("decoder")
    if lib is None or not lib.int8_grouped_available():
        return None
    return _function("decoder", "decoder_forward", [_PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _PTR, _PTR,
                                                    _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR,
                                                    _I64, _I64, _F32, _I64, _I64, _PTR])


def decoder_stack_available() -> bool:
    """Whether the one-call decoder stack (kernels/decoder.c: int8 or GGUF-block projections) runs on this CPU
    (AVX512-VNNI or AVX2)."""
    return _decoder_fn() is not None


def decoder_work_floats(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> int:
    """Scratch floats per token that `decoder_forward` needs."""
    return 2 * hidden + (heads + 2 * kv_heads) * head_dim + 2 * heads * head_dim + 3 * intermediate


def decoder_forward(layers: ctypes.Array, dims: tuple[int, int, int, int, int], eps: float, residual: torch.Tensor,
                    work: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                    local_rope: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor, block_size: int,
                    query_start: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                    kv_kind: int, gelu: bool, lora: LoRABatchPointers | None = None) -> torch.Tensor:
    """Every decoder layer over a flat batch in one call. dims = (hidden, heads, kv_heads, head_dim,
    intermediate); residual [T, hidden] float32: the embeddings in, the residual stream out (in place); work: at
    least T * decoder_work_floats(...) floats; rope and local_rope: (cos, sin) rows [T, head_dim] of the layers
    without and with `local_rope`; kv_kind: the caches' format (kv_formats.h); gelu: GeGLU MLPs. Returns the
    last layer's MLP output [T, hidden]."""
    fn = _decoder_fn()
    hidden, heads, kv_heads, head_dim, intermediate = dims
    tokens = residual.shape[0]
    assert fn is not None and residual.is_contiguous() and residual.dtype == torch.float32
    assert work.numel() >= tokens * decoder_work_floats(*dims)
    assert all(table.is_contiguous() and table.shape == (tokens, head_dim) for table in (*rope, *local_rope))
    for index in (slot_mapping, query_start, seq_lens, block_tables):
        assert index.dtype == torch.int64 and index.is_contiguous()
    x_out = torch.empty(tokens, hidden)
    fn(ctypes.addressof(layers), len(layers), tokens, hidden, heads, kv_heads, head_dim, intermediate, eps,
       residual.data_ptr(), x_out.data_ptr(), work.data_ptr(), rope[0].data_ptr(), rope[1].data_ptr(),
       local_rope[0].data_ptr(), local_rope[1].data_ptr(), slot_mapping.data_ptr(), block_size,
       query_start.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(), seq_lens.shape[0], block_tables.shape[1],
       scale, kv_kind, int(gelu), None if lora is None else ctypes.addressof(lora))
    return x_out


class LoRAWeightsPointers(ctypes.Structure):
    """One projection's LoRA parts in the resident slots (kernels/lora.c: LoRAWeights), as raw addresses."""

    _fields_ = [("parts", _I64), ("in_features", _I64), ("max_rank", _I64), ("offset", _PTR), ("width", _PTR),
                ("at", _PTR), ("bt", _PTR), ("ranks", _PTR), ("slots", _I64), ("bf16", _I64)]


class LoRABatchPointers(ctypes.Structure):
    """A step's rows grouped by adapter slot (kernels/lora.c: LoRABatch)."""

    _fields_ = [("segments", _I64), ("slot", _PTR), ("start", _PTR), ("rows", _PTR)]


@functools.cache
def _lora_fn() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return _function("lora", "lora_add", [_PTR, _PTR, _PTR, _I64, _PTR, _I64])


def lora_add_supported(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and _lora_fn() is not None


def lora_add(weights: LoRAWeightsPointers, batch: LoRABatchPointers, x: torch.Tensor, y: torch.Tensor) -> None:
    """In place: y[row, part columns] += (x[row] @ At[slot]) @ Bt[slot] for the batch's rows (kernels/lora.c).
    x [T, in], y [T, out] float32 with unit column stride."""
    fn = _lora_fn()
    assert fn is not None and x.stride(1) == 1 and y.stride(1) == 1 and x.dtype == y.dtype == torch.float32
    fn(ctypes.addressof(weights), ctypes.addressof(batch), x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0))


# the attention kernel's loading and calls live in their own module (it needs the helpers above)
from tokenmill.kernels.kv_attention import (  # noqa: E402, F401 - re-exported: kernels.paged_attention & co.
    attention_bf16_available,
    attention_supported,
    bf16_cache_supported,
    cache_pointers,
    integer_attention,
    key_channel_pointer,
    native_attention_available,
    paged_attention,
)
