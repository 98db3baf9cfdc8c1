"""Every model family against transformers on tiny random-weight models (made here from a config, saved as a
Hugging Face directory): greedy tokens identical in float32, alone and batched, under chunked prefill and
prefix-cache hits, with prompts longer than the sliding windows and past the original context of rope scaling.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import DEVICE
from tokenmill import LLM, SamplingParams, kernels
from tokenmill.config import EngineConfig

VOCAB = 384
NEW_TOKENS = 12
# 2-4 layers, small widths, and each family's real options; windows and original contexts far below the prompts
BASE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "initializer_range": 0.3,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"num_hidden_layers": 2}),
    "llama3-rope": ("LlamaConfig", {"num_hidden_layers": 2, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "llama-linear-rope": ("LlamaConfig", {"num_hidden_layers": 2, "rope_parameters": {
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
    "llama-yarn-rope": ("LlamaConfig", {"num_hidden_layers": 2, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}}),
    "llama-dynamic-rope": ("LlamaConfig", {"num_hidden_layers": 2, "max_position_embeddings": 32,
                                           "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0,
                                                               "factor": 4.0}}),
    # Phi-4-mini's shape: fused projections, 3/4 of each head rotating, longrope past a 32-token original context
    "phi3-longrope-partial": ("Phi3Config", {
        "num_hidden_layers": 2, "pad_token_id": 0, "original_max_position_embeddings": 32,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}}),
    "mistral-window": ("MistralConfig", {"num_hidden_layers": 2, "sliding_window": 12, "head_dim": 16}),
    "qwen2": ("Qwen2Config", {"num_hidden_layers": 2, "tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"num_hidden_layers": 3, "head_dim": 32}),
    "phi3-window": ("Phi3Config", {"num_hidden_layers": 2, "sliding_window": 14, "pad_token_id": 0}),
    "gemma3": ("Gemma3TextConfig", {
        "num_hidden_layers": 4, "head_dim": 32, "sliding_window": 10, "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        "tie_word_embeddings": True, "rope_parameters": {
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
}


def _save_tokenizer(path: Path) -> None:
    """A word-level tokenizer over the model's vocabulary: the tests feed token ids, the engine needs one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.ByteLevel()  # ASCII words decode as themselves; grammars read the vocabulary
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "w1", "eos_token": "w2"}))


def _tiny_model(name: str, path: Path, **overrides: Any) -> Any:
    """The family's tiny random model (config `overrides` on top), saved with a tokenizer (and no chat template)
    under `path`."""
    import transformers

    config_class, options = FAMILIES[name]
    config = getattr(transformers, config_class)(**(BASE | options | overrides))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    _save_tokenizer(path)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, Path, Any]:  # noqa: ANN001
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, _tiny_model(request.param, path)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 23, 47, 70]  # past every window (10-12) and original context (16-32)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _hf_greedy(model: Any, prompt: list[int]) -> list[int]:
    """Greedy with EOS ignored (tokenmill's ignore_eos): no stop and no EOS masking (min_new_tokens would mask)."""
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_tokens_match_transformers(family: tuple[str, Path, Any]) -> None:
    name, path, model = family
    prompts = _prompts()
    expected = [_hf_greedy(model, p) for p in prompts]
    # 16-token budget: the long prompts are prefilled in chunks; all four share every step
    llm = LLM(str(path), device=DEVICE, quantization="none", max_num_batched_tokens=16, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [list(o.outputs[0].token_ids) for o in batched] == expected, name
    alone = [llm.generate({"prompt_token_ids": p}, params)[0] for p in prompts[2:]]  # now hits the prefix cache
    assert llm.engine.core.kv.prefix_hits > 0
    assert [list(o.outputs[0].token_ids) for o in alone] == expected[2:], name


def test_int8_speculation_and_structured_outputs_work_for_every_family(family: tuple[str, Path, Any]) -> None:
    """The engine's features on each family: int8 weights (the native decoder stack where the family allows),
    speculation (the family's model drafting for itself) token-identical to plain greedy, and a structured-output
    choice obeyed."""
    name, path, _ = family
    prompts = [p[:30] for p in _prompts()[1:]]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    plain = LLM(str(path), device=DEVICE, quantization="int8")
    expected = [list(o.outputs[0].token_ids) for o in plain.generate(
        [{"prompt_token_ids": p} for p in prompts], params)]
    speculating = LLM(str(path), device=DEVICE, quantization="int8", speculative_config={
        "method": "draft_model", "model": str(path), "quantization": "int8", "num_speculative_tokens": 3})
    outputs = speculating.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected, name
    assert speculating.engine.core.scheduler.spec.accepted_tokens > 0
    # "v" (no token spells it) keeps a first byte from being forced: the word-level test vocabulary cannot
    # tokenize a forced lone "w"
    choice = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs={"choice": ["w7w9", "w5w3", "v"]})
    output = plain.generate({"prompt_token_ids": prompts[0]}, choice)[0].outputs[0]
    assert output.text in ("w7w9", "w5w3") and output.finish_reason == "stop", (name, output)


@pytest.mark.skipif(not kernels.decoder_stack_available(), reason="no AVX2/AVX512-VNNI: the layers run one by one")
@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_the_native_decoder_stack_is_bit_identical_to_the_layers_for_every_family(
        family: tuple[str, Path, Any], kv: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels/decoder.c runs every family option (QK-norm, sandwich norms, GeGLU, windows, local rope tables,
    partial rotary) with the kernels the layers call one by one: the same logits to the bit, over a prompt
    longer than every window."""
    from tokenmill.executor.model_runner import ModelRunner
    from tokenmill.model import llama
    from tokenmill.model.loader import load_model

    name, path, _ = family
    loaded = load_model(str(path))
    config = EngineConfig(quantization="int8", kv_cache_dtype=kv, num_kv_blocks=16, block_size=16)
    prompt = _prompts()[-1]
    fast = ModelRunner(config, loaded.config, loaded.weights)
    assert fast.model._stack is not None, f"{name}: the native decoder stack did not engage"
    logits = fast.prompt_logits(prompt)
    monkeypatch.setattr(llama.NativeDecoderStack, "supported", staticmethod(lambda model: False))
    slow = ModelRunner(config, loaded.config, loaded.weights)
    assert slow.model._stack is None
    assert torch.equal(slow.prompt_logits(prompt), logits), name


def test_family_options_read_from_the_config(family: tuple[str, Path, Any]) -> None:
    """The options that make each family differ reach ModelConfig (a parity pass could not tell which was off
    if the family's quirk happened not to matter)."""
    from tokenmill.model.loader import load_model

    name, path, _ = family
    config = load_model(str(path)).config
    if name == "gemma3":
        assert config.sandwich_norm and config.qk_norm and config.hidden_act == "gelu_tanh"
        assert config.sliding_window == 10 and config.sliding_layers == (0, 1, 2)
        assert config.rope_local_theta == 10000.0 and config.rope_scaling.rope_type == "linear"
        assert config.embed_scale == pytest.approx(8.0) and config.attn_scale == pytest.approx(24**-0.5)
    elif name == "qwen3":
        assert config.qk_norm and not config.qkv_bias and config.head_dim == 32
    elif name == "qwen2":
        assert config.qkv_bias and config.tie_word_embeddings
    elif name == "mistral-window":
        assert config.sliding_window == 12 and config.sliding_layers == (0, 1)
    elif name == "phi3-window":
        assert config.sliding_window == 14 and config.sliding_layers == (0, 1)
    elif name == "phi3-longrope-partial":
        assert config.rotary_dim == 12 and config.rope_scaling.rope_type == "longrope"
        assert config.rope_scaling.original_max_position_embeddings == 32
        assert config.rope_cache_key(32) == 0 and config.rope_cache_key(33) == 1
    elif name.endswith("-rope"):
        expected = {"llama3-rope": "llama3", "llama-linear-rope": "linear", "llama-yarn-rope": "yarn",
                    "llama-dynamic-rope": "dynamic"}[name]
        assert config.rope_scaling.rope_type == expected
        if expected == "dynamic":  # NTK scaling serves factor x the trained context
            assert config.max_context_len == 128 and config.rope_cache_key(40) == 40
    else:  # a plain Llama: no family option set
        assert not (config.qk_norm or config.sandwich_norm or config.hidden_act != "silu" or config.embed_scale
                    or config.sliding_layers or config.final_logit_softcapping)


def test_unsupported_families_and_options_are_named(tmp_path: Path) -> None:
    from tokenmill.model.families import hf_model_config

    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'.*gemma3_text"):
        hf_model_config(BASE | {"model_type": "gpt2", "num_hidden_layers": 1})
    with pytest.raises(ValueError, match="rope scaling type 'mrope' is not supported"):
        hf_model_config(BASE | {"model_type": "llama", "num_hidden_layers": 1,
                                "rope_scaling": {"rope_type": "mrope", "mrope_section": [2, 2]}})


def test_eos_ids_join_config_and_generation_config(tmp_path: Path) -> None:
    """Llama 3 ends a turn with <|eot_id|> or <|eom_id|>: generation_config.json lists them all."""
    from tokenmill.model.families import read_hf_config

    (tmp_path / "config.json").write_text(json.dumps(BASE | {"model_type": "llama", "num_hidden_layers": 1,
                                                             "eos_token_id": 128001}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128008, 128009]}))
    config, _ = read_hf_config(str(tmp_path))
    assert config.eos_token_ids == (128001, 128008, 128009)


def _gguf_writer(path: Path, arch: str, config: Any, rotary_dim: int) -> Any:
    """A GGUFWriter with the model's shape and a BPE vocabulary (the tests feed token ids), as llama.cpp's
    converter writes them."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(rotary_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    writer.add_token_types([1] * VOCAB)
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    return writer


def _finish(writer: Any) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_llama_gguf(path: Path, model: Any, rope: dict[str, float]) -> None:
    """The tiny Llama 3 model as llama.cpp's converter writes it: q/k rows permuted for interleaved rotary,
    the llama3 rope scaling precomputed into `rope_freqs.weight` (llama.cpp's formula), a BPE vocabulary."""
    import math

    config = model.config
    heads, kv_heads, hidden = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
    head_dim = hidden // heads
    writer = _gguf_writer(path, "llama", config, head_dim)

    def permute(w: torch.Tensor, n: int) -> torch.Tensor:
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    state = {k: v.float() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"].numpy())
    writer.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
    writer.add_tensor("output.weight", state["lm_head.weight"].numpy())
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_q.weight", permute(state[p + "self_attn.q_proj.weight"], heads).numpy())
        writer.add_tensor(f"blk.{i}.attn_k.weight", permute(state[p + "self_attn.k_proj.weight"], kv_heads).numpy())
        for hf_name, gguf_name in names.items():
            writer.add_tensor(f"blk.{i}.{gguf_name}.weight", state[p + hf_name + ".weight"].numpy())
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    writer.add_tensor("rope_freqs.weight", torch.tensor(factors, dtype=torch.float32).numpy())
    _finish(writer)


def _write_phi3_gguf(path: Path, model: Any) -> None:
    """The tiny Phi-4-mini-shaped model as llama.cpp's converter writes it: fused attn_qkv and ffn_up (gate
    and up rows), the rotated width as rope.dimension_count, longrope's factors as tensors and its mscale as
    rope.scaling.attn_factor."""
    import math

    config = model.config
    rope = config.rope_parameters
    rotary_dim = int(config.hidden_size // config.num_attention_heads * rope["partial_rotary_factor"])
    writer = _gguf_writer(path, "phi3", config, rotary_dim)
    original = rope["original_max_position_embeddings"]
    writer.add_rope_scaling_orig_ctx_len(original)
    scale = config.max_position_embeddings / original
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.add_tensor("output.weight", state["lm_head.weight"])
    writer.add_tensor("rope_factors_long.weight", torch.tensor(rope["long_factor"]).numpy())
    writer.add_tensor("rope_factors_short.weight", torch.tensor(rope["short_factor"]).numpy())
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i in range(config.num_hidden_layers):
        for hf_name, gguf_name in names.items():
            writer.add_tensor(f"blk.{i}.{gguf_name}.weight", state[f"model.layers.{i}.{hf_name}.weight"])
    _finish(writer)


def test_llama3_gguf_with_rope_freqs_matches_transformers(tmp_path: Path) -> None:
    """A Llama 3 GGUF carries its rope scaling as per-frequency factors (`rope_freqs.weight`); tokenmill reads
    them and gives transformers' tokens on the Hugging Face model the file was written from."""
    import transformers

    rope = FAMILIES["llama3-rope"][1]["rope_parameters"]
    config = transformers.LlamaConfig(**(BASE | {"num_hidden_layers": 2, "rope_parameters": rope}))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path / "tiny-llama3.gguf"
    _write_llama_gguf(path, model, rope)
    llm = LLM(str(path), device=DEVICE, quantization="none", max_num_batched_tokens=16)
    from tokenmill.model.loader import load_model

    assert load_model(str(path)).config.rope_scaling.freq_factors is not None
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = _prompts()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [_hf_greedy(model, p) for p in prompts]


def test_phi3_gguf_with_longrope_factors_matches_transformers(tmp_path: Path) -> None:
    """A Phi-3.5/Phi-4-mini GGUF: fused tensors, partial rotary and longrope read from the file's tensors and
    keys; transformers' tokens on the Hugging Face model the file was written from, short and long prompts."""
    import transformers

    config = transformers.Phi3Config(**(BASE | FAMILIES["phi3-longrope-partial"][1]))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path / "tiny-phi4-mini.gguf"
    _write_phi3_gguf(path, model)
    from tokenmill.model.loader import load_model

    loaded = load_model(str(path)).config
    assert loaded.rotary_dim == 12 and loaded.rope_scaling.rope_type == "longrope"
    llm = LLM(str(path), device=DEVICE, quantization="none", max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = _prompts()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [_hf_greedy(model, p) for p in prompts]


def test_chat_needs_a_template(tmp_path: Path) -> None:
    """A model without a chat template: chat requests get a 400 naming the fix, completions still work, and
    `--chat-template FILE` (vLLM's flag) supplies one."""
    import httpx

    from tokenmill.bench.server_process import live_server

    _tiny_model("llama", tmp_path)
    chat = {"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 3}
    with live_server(str(tmp_path)) as server:
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        refused = httpx.post(server.url + "/v1/chat/completions", json=chat | {"model": model}, timeout=60)
        completion = httpx.post(server.url + "/v1/completions", timeout=60,
                                json={"model": model, "prompt": "w5 w6", "max_tokens": 3})
    assert refused.status_code == 400
    assert "no chat template" in refused.json()["error"]["message"]
    assert "--chat-template" in refused.json()["error"]["message"]
    assert completion.status_code == 200
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}")
    with live_server(str(tmp_path), "--chat-template", str(template)) as server:
        reply = httpx.post(server.url + "/v1/chat/completions", json=chat | {"model": model}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == 4  # w3 w5 w6 w4: the template's words


def test_lora_adapter_matches_peft_for_every_family(family: tuple[str, Path, Any], tmp_path: Path) -> None:
    """A PEFT adapter on every linear projection of the family's model (fused ones too: Phi-3's qkv_proj and
    gate_up_proj; partial rotary's reordered q/k rows): greedy tokens equal transformers + PEFT in float32,
    alone and in a batch with base-model requests."""
    import copy

    from peft import LoraConfig, PeftModel, get_peft_model

    from tokenmill import LoRARequest

    name, path, model = family
    torch.manual_seed(3)
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                                 init_lora_weights=False))
    with torch.no_grad():
        for parameter_name, tensor in peft_model.named_parameters():
            if "lora_A" in parameter_name:
                tensor.normal_(0, tensor.shape[1] ** -0.5)
            elif "lora_B" in parameter_name:
                tensor.normal_(0, 0.3)
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    reference = PeftModel.from_pretrained(copy.deepcopy(model), str(tmp_path / "adapter")).eval()
    prompts = _prompts()
    expected = [_hf_greedy(reference, p) for p in prompts]
    base = [_hf_greedy(model, p) for p in prompts]
    llm = LLM(str(path), device=DEVICE, quantization="none", enable_lora=True, max_lora_rank=8,
              max_num_batched_tokens=16)
    lora = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    with torch.no_grad():  # the adapter moves the logits (a tiny random model's argmax may not move)
        peft_logits = reference(torch.tensor([prompts[1]])).logits[0]
        assert (peft_logits - model(torch.tensor([prompts[1]])).logits[0]).abs().max() > 1.0
    ours = llm.engine.core.executor.prompt_logits(prompts[1], lora)  # type: ignore[attr-defined]
    assert torch.allclose(ours, peft_logits, atol=1e-3, rtol=1e-4), name
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    jobs = [{"prompt_token_ids": p} for p in prompts]
    outputs = llm.generate(jobs + jobs, params, lora_request=[lora] * len(jobs) + [None] * len(jobs))
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected + base, name


def test_longrope_generation_crossing_the_original_context_matches_transformers(tmp_path: Path) -> None:
    """transformers' Phi-3 recomputes the whole cache with the long factors when a sequence first grows past
    original_max_position_embeddings (32 here); tokenmill computes such a sequence again from its start at that
    step. Prompts of 20-31 tokens cross while generating: alone, batched with prompts that do not cross, under
    n-gram speculation, and followed by a short request on the same prompt (the short-factor blocks in the
    prefix cache stay valid for it)."""
    name = "phi3-longrope-partial"
    model = _tiny_model(name, tmp_path)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (20, 26, 31, 8, 40)]
    expected = [_hf_greedy(model, p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = LLM(str(tmp_path), device=DEVICE, quantization="none", max_num_batched_tokens=16)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)  # 20 + 2 stays below 32
    assert list(llm.generate({"prompt_token_ids": prompts[0]}, short)[0].outputs[0].token_ids) == expected[0][:2]
    assert llm.engine.core.kv.prefix_hits > 0
    speculating = LLM(str(tmp_path), device=DEVICE, quantization="none", speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    outputs = speculating.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


@pytest.mark.parametrize("kind", ["default", "llama3", "longrope"])
def test_rope_tables_grow_by_blocks_bit_identical_to_transformers(kind: str) -> None:
    """The cos/sin tables start with one block of positions and grow a block at a time as sequences reach
    further (rope.TABLE_BLOCK): every row equals transformers' rotary embedding for that position, bit for bit
    (longrope: its long factors, which transformers takes for a sequence past the original context), and a row
    never depends on how far the table had grown when it was read."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from tokenmill.model.rope import TABLE_BLOCK, RotaryEmbedding
    from tokenmill.model.rope_scaling import RopeScaling

    context, head_dim = 3 * TABLE_BLOCK, 32
    parameters: dict[str, Any] = {"rope_type": kind, "rope_theta": 10000.0}
    if kind == "llama3":
        parameters |= {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 1024}
    if kind == "longrope":
        parameters |= {"long_factor": [1.0 + i / 8 for i in range(head_dim // 2)],
                       "short_factor": [1.0] * (head_dim // 2), "original_max_position_embeddings": 1024}
    config = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4,
                                      max_position_embeddings=context, rope_parameters=parameters)
    positions = torch.arange(2 * TABLE_BLOCK + 17)
    reference = LlamaRotaryEmbedding(config)(torch.zeros(1, len(positions), head_dim), positions[None])

    def tables(rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        return rope.long_tables if rope.long_tables is not None else (rope.cos, rope.sin)

    scaling = RopeScaling.from_hf(parameters, context)
    grown, whole = (RotaryEmbedding(head_dim, 10000.0, context, scaling) for _ in range(2))
    assert grown.cos.shape[0] == TABLE_BLOCK
    grown.reserve(TABLE_BLOCK + 1)
    grown.reserve(len(positions))
    whole.reserve(context)
    assert grown.cos.shape[0] == len(tables(grown)[0]) == 3 * TABLE_BLOCK
    for table, expected, whole_table in zip(tables(grown), reference, tables(whole)):
        assert torch.equal(table[positions], expected[0])
        assert torch.equal(table, whole_table[:len(table)])


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_generation_past_the_first_rope_block_matches_transformers(name: str, tmp_path: Path) -> None:
    """A prompt that crosses the rope tables' first block while it is prefilled in chunks (the tables grow in
    the step that reaches it; Gemma 3 has a second, local table) gives transformers' greedy tokens, batched with
    a short prompt that never needs the growth."""
    from tokenmill.model.rope import TABLE_BLOCK

    model = _tiny_model(name, tmp_path, max_position_embeddings=3 * TABLE_BLOCK)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (TABLE_BLOCK - 4, 9)]
    expected = [_hf_greedy(model, p) for p in prompts]
    llm = LLM(str(tmp_path), device=DEVICE, quantization="none", max_num_batched_tokens=1024)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    transformer = llm.engine.core.executor.model
    tables = [transformer.rope] + ([transformer.local_rope] if transformer.local_rope is not None else [])
    assert [rope.cos.shape[0] for rope in tables] == [2 * TABLE_BLOCK] * (2 if name == "gemma3" else 1)
