"""Loading: GGUF of every supported tensor type and HF safetensors directories (llama, mistral, qwen2),
each checked against transformers loading the same files."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tokenmill.config import EngineConfig
from tokenmill.core.outputs import ScheduledRequest, SchedulerOutput
from tokenmill.executor.model_runner import ModelRunner
from tokenmill.model.loader import load_model
from tokenmill.sampling_params import SamplingParams

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 512, 4, 2, 2, 300


def _our_logits(path: str, ids: list[int]) -> torch.Tensor:
    loaded = load_model(path)
    runner = ModelRunner(EngineConfig(num_kv_blocks=8, quantization="none"), loaded.config, loaded.weights)
    plan = SchedulerOutput([ScheduledRequest("x", ids, 0, list(range(8)), True, SamplingParams(), ids, [])])
    _, logits = runner.compute_logits(plan)
    assert logits is not None
    return logits[0]


def _hf_logits(model, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


# ------------------------------------------------------------------ GGUF with every tensor type


def _k_quant_bytes(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with sane fp16 scales (gguf-py can dequantize K-quants but not quantize them)."""
    blocks = rows * cols // 256
    size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[kind]
    raw = rng.integers(0, 256, size=(blocks, size), dtype=np.uint8)
    scale = np.array([0.002], dtype=np.float16).view(np.uint8)
    if kind == "Q6_K":
        raw[:, 208:210] = scale
    else:
        raw[:, 0:2] = scale
        raw[:, 2:4] = np.array([0.001], dtype=np.float16).view(np.uint8)
    return raw.reshape(rows, cols // 256 * size)


def _permute_for_gguf(w: np.ndarray, heads: int) -> np.ndarray:
    # what llama.cpp's converter does to q/k rows
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_gguf(path: str) -> None:
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    tokens = [f"t{i}" for i in range(VOCAB)]
    writer.add_token_list(tokens)
    writer.add_token_types([1] * VOCAB)
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    types = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
    counter = iter(range(10_000))

    def add(name: str, shape: tuple[int, ...], scale: float = 0.05, permute_heads: int = 0) -> None:
        value = (rng.standard_normal(shape) * scale).astype(np.float32)
        if len(shape) == 1:
            writer.add_tensor(name, 1.0 + value)
            return
        if permute_heads:
            value = _permute_for_gguf(value, permute_heads)
        kind = types[next(counter) % len(types)]
        if kind.name.endswith("_K"):
            writer.add_tensor(name, _k_quant_bytes(kind.name, *shape, rng), raw_dtype=kind)
        elif kind == Q.F32:
            writer.add_tensor(name, value)
        elif kind == Q.F16:
            writer.add_tensor(name, value.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(value, kind), raw_dtype=kind)

    add("token_embd.weight", (VOCAB, HIDDEN), 0.5)
    add("output_norm.weight", (HIDDEN,))
    add("output.weight", (VOCAB, HIDDEN))
    for i in range(LAYERS):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (HIDDEN,))
        add(p + "ffn_norm.weight", (HIDDEN,))
        add(p + "attn_q.weight", (HIDDEN, HIDDEN), permute_heads=HEADS)
        add(p + "attn_k.weight", (KV_HEADS * 64, HIDDEN), permute_heads=KV_HEADS)
        add(p + "attn_v.weight", (KV_HEADS * 64, HIDDEN))
        add(p + "attn_output.weight", (HIDDEN, HIDDEN))
        add(p + "ffn_gate.weight", (FFN, HIDDEN))
        add(p + "ffn_up.weight", (FFN, HIDDEN))
        add(p + "ffn_down.weight", (HIDDEN, FFN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_with_every_tensor_type_matches_transformers(tmp_path) -> None:  # noqa: ANN001
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    path = str(tmp_path / "tiny.gguf")
    _write_tiny_gguf(path)
    kinds = {t.tensor_type.name for t in GGUFReader(path).tensors}
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"} <= kinds
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32).eval()
    ids = [5, 17, 42, 99, 7, 250, 3, 11]
    ours, expected = _our_logits(path, ids), _hf_logits(hf, ids)
    assert (ours - expected).abs().max() / expected.abs().max() < 1e-4


# ------------------------------------------------------------------ HF directories


def _tiny_hf_model(kind: str):  # noqa: ANN202
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
    config = {"llama": lambda: LlamaConfig(**common, rope_theta=50000.0, tie_word_embeddings=False),
              "mistral": lambda: MistralConfig(**common, sliding_window=None),
              "qwen2": lambda: Qwen2Config(**common, tie_word_embeddings=True)}[kind]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    if kind == "qwen2":  # make the qkv biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 0.5)
                layer.self_attn.k_proj.bias.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_hf_safetensors_dir_matches_transformers(tmp_path, kind: str) -> None:  # noqa: ANN001
    model = _tiny_hf_model(kind)
    model.save_pretrained(tmp_path, safe_serialization=True)
    assert any(f.endswith(".safetensors") for f in os.listdir(tmp_path))
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["model_type"] == kind
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    ours, expected = _our_logits(str(tmp_path), ids), _hf_logits(model, ids)
    assert (ours - expected).abs().max() / expected.abs().max() < 1e-4


def test_bundled_model_saved_as_hf_dir_runs_end_to_end(tmp_path, hf_model, hf_tokenizer) -> None:  # noqa: ANN001
    from safetensors.torch import save_file

    from tokenmill import LLM, SamplingParams

    # transformers will not re-serialize a GGUF-loaded model, so write the HF layout by hand.
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf_tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), num_kv_blocks=64, quantization="none")
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))[0]
    ids = hf_tokenizer("The capital of France is").input_ids
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):]
    assert out.outputs[0].token_ids == expected.tolist()
    assert out.outputs[0].text == hf_tokenizer.decode(expected, skip_special_tokens=True)


def test_missing_model_path_is_a_clear_error() -> None:
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        load_model("/nonexistent/model.gguf")


def test_gguf_file_reads_what_the_gguf_package_reads(model_path: str) -> None:
    """tokenmill's header reader (model/gguf_file.py) against the `gguf` package's GGUFReader: every metadata
    value and every tensor's name, type, shape and bytes."""
    import numpy as np
    from gguf import GGUFReader

    from tokenmill.model.gguf_file import GGUFFile

    ours, reference = GGUFFile(model_path), GGUFReader(model_path)
    counts = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")  # the reader's own header entries
    expected = {k: f.contents() for k, f in reference.fields.items() if k not in counts}
    assert ours.fields == expected
    assert len(ours.tensors) == len(reference.tensors) > 100
    for mine, theirs in zip(ours.tensors, reference.tensors):
        assert (mine.name, mine.tensor_type, mine.shape) == (theirs.name, theirs.tensor_type,
                                                             tuple(int(d) for d in theirs.shape))
        assert mine.data.shape == theirs.data.shape and np.array_equal(mine.data, theirs.data)


def test_lazy_weights_answer_membership_without_reading() -> None:
    """`name in weights` must not dequantize the tensor (Mapping's default __contains__ reads it: every weight
    was converted twice at load)."""
    from tokenmill.model.loader import LazyWeights

    reads: list[str] = []

    def reader(name: str):  # noqa: ANN202
        return lambda: reads.append(name) or torch.zeros(1)

    weights = LazyWeights({"a": reader("a"), "b": reader("b")})
    assert "a" in weights and "c" not in weights and reads == []
    weights["b"]
    assert reads == ["b"]


# ------------------------------------------------------------------ GGUF blocks decoded natively


def _blocks_of_every_type() -> list[tuple[object, np.ndarray, int, int]]:
    """(type, bytes [rows, row bytes], rows, cols) for every type gguf_blocks.c decodes: the `gguf` package
    quantizes the simple ones; the k-quants (which it cannot quantize) are random bytes with finite scales."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    rows, cols = 24, 512
    weight = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    weight[3, 7] = 0.9  # an outlier row
    out = [(t, np.ascontiguousarray(quantize(weight, t)).view(np.uint8).reshape(rows, -1), rows, cols)
           for t in (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)]
    # block bytes, and the offsets of its fp16 scales
    k_quants = {T.Q2_K: (84, (80, 82)), T.Q3_K: (110, (108,)), T.Q4_K: (144, (0, 2)), T.Q5_K: (176, (0, 2)),
                T.Q6_K: (210, (208,))}
    for t, (size, scales) in k_quants.items():
        blocks = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
        for at in scales:
            scale = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16)
            blocks[:, at:at + 2] = scale.view(np.uint8).reshape(-1, 2)
        out.append((t, blocks.reshape(rows, -1), rows, cols))
    return out


def test_native_block_decoding_is_bit_identical_to_the_gguf_package() -> None:
    from gguf.quants import dequantize

    from tokenmill import kernels
    from tokenmill.model.int8_linear import quantize_rows

    for kind, data, rows, cols in _blocks_of_every_type():
        assert kernels.gguf_decodable(int(kind), cols), kind
        expected = torch.from_numpy(np.asarray(dequantize(data, kind), dtype=np.float32).reshape(rows, cols))
        ours = kernels.gguf_dequantize(data, int(kind), rows, cols)
        assert torch.equal(ours.view(torch.int32), expected.view(torch.int32)), kind
        q, scale = kernels.gguf_to_int8_rows(data, int(kind), rows, cols)
        q_expected, scale_expected = quantize_rows(expected)
        assert torch.equal(q, q_expected) and torch.equal(scale, scale_expected.squeeze(1)), kind
        index = torch.tensor([5, 0, 23, 5])
        assert torch.equal(kernels.gguf_gather_rows(data, int(kind), rows, cols, index), expected[index]), kind
    with pytest.raises(IndexError):
        kernels.gguf_gather_rows(data, int(kind), rows, cols, torch.tensor([rows]))


def test_int8_layers_from_blocks_equal_int8_from_float32(model_path: str) -> None:
    """An int8 model loaded from the file's blocks (no float32 copy) is the one built from the float32
    dequantization: same weights, same logits, bit for bit."""
    from tokenmill.model.int8_linear import Int8Linear
    from tokenmill.model.llama import LlamaForCausalLM
    from tokenmill.model.loader import LazyWeights

    loaded = load_model(model_path)
    assert isinstance(loaded.weights, LazyWeights) and loaded.weights.int8_rows("model.embed_tokens.weight") is not None
    from_blocks = LlamaForCausalLM(loaded.config, "int8")
    from_blocks.load_weights(loaded.weights)
    from_float = LlamaForCausalLM(loaded.config, "int8")
    from_float.load_weights({name: loaded.weights[name] for name in loaded.weights})  # a plain dict: float32
    pairs = [(name, a, b) for (name, a), b in zip(from_blocks.named_modules(), from_float.modules())
             if isinstance(a, Int8Linear) and isinstance(b, Int8Linear)]
    assert len(pairs) == 4 * loaded.config.num_layers + 1
    for name, a, b in pairs:
        assert torch.equal(a.scale, b.scale) and torch.equal(a.qweight, b.qweight), name
        assert (a.packed is None) == (b.packed is None) and (a.packed is None or torch.equal(a.packed, b.packed))


def _resident_bytes_of_mapping(address: int) -> int:
    """Rss of the mapping of this process that contains `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(v, 16) for v in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds that address")


def test_repacked_gguf_weights_drop_the_files_pages() -> None:
    """--quantization gguf on a panel-kernel host: every projection's blocks are repacked (about the file's
    bytes, not int8's), and the file's own pages are no longer resident once the model is built, so the weights
    are in memory once, not twice."""
    from tokenmill import kernels
    from tokenmill.model.gguf_linear import GGUFLinear

    if not kernels.gguf_panels_available():
        pytest.skip("no AVX512-VNNI: GGUF blocks are read in place from the file's pages")
    loaded = load_model(None)
    assert loaded.gguf_reader is not None
    file_map = loaded.gguf_reader._map
    runner = ModelRunner(EngineConfig(num_kv_blocks=8, quantization="gguf"), loaded.config, loaded.weights)
    plans = [m.plan for m in runner.model.modules() if isinstance(m, GGUFLinear) and m.plan is not None]
    assert plans and all(plan.panels for plan in plans)
    packed = sum(plan.nbytes for plan in plans)
    stored = sum(part.data.nbytes for m in runner.model.modules() if isinstance(m, GGUFLinear) for part, _ in m.parts)
    assert stored <= packed <= 1.03 * stored  # the file's bits, interleaved: within 3% of its bytes
    resident = _resident_bytes_of_mapping(int(file_map.ctypes.data))
    assert resident < 0.1 * file_map.nbytes, f"{resident} of {file_map.nbytes} file bytes still resident"
