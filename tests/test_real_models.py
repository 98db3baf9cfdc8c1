"""The real GGUF files (tests/real_models.py fetches them into a cache): float32 greedy parity with transformers
reading the same file, the int8 quality gate, and a chat completion through the server on each.

Greedy parity is exact, except that a divergence is accepted at a step where transformers' own top two
logits are within NEAR_TIE nats (float32 sums in another order can flip such a step); every divergence is
printed.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.real_models import GEMMA3_270M, QWEN25_CODER_05B, RealModel, fetch
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.executor.model_runner import ModelRunner
from tokenmill.model.gguf_file import GGUFFile
from tokenmill.model.loader import load_model
from tokenmill.model.metadata import gguf_field

NEAR_TIE = 0.05
NEW_TOKENS = 24
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "List three colors:\n1.", "Water boils at", "import numpy as np\n\n# compute the mean of an array\n",
           " ".join(["The quick brown fox jumps over the lazy dog."] * 60)]  # past Gemma 3's 512-token window


@pytest.fixture(scope="module", params=[QWEN25_CODER_05B, GEMMA3_270M], ids=lambda m: m.file.split("-q4")[0])
def real(request) -> Path:  # noqa: ANN001
    model: RealModel = request.param
    return fetch(model)


@pytest.fixture(scope="module")
def hf(real: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(real.parent, gguf_file=real.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(real.parent, gguf_file=real.name)


@pytest.fixture(scope="module")
def float_llm(real: Path) -> LLM:
    # no prefix cache: between requests its runner holds nothing, so the quality gate can score on it
    return LLM(str(real), quantization="none", max_num_batched_tokens=256, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def float_outputs(float_llm: LLM) -> list[Any]:
    """Greedy float32 continuations of the prompts, EOS ignored: compared with transformers, then scored."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return float_llm.generate(PROMPTS, params)


def _first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)


def test_float32_greedy_matches_transformers(real: Path, hf: tuple[Any, Any], float_outputs: list[Any]) -> None:
    model, tokenizer = hf
    model.generation_config.eos_token_id = None  # EOS ignored on both sides, and not masked either
    exact = 0
    for prompt, out in zip(PROMPTS, float_outputs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist(), f"tokenization differs on {prompt[:40]!r}"
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
        theirs = ref.sequences[0, ids.shape[1]:].tolist()
        ours = list(out.outputs[0].token_ids)
        step = _first_divergence(ours, theirs)
        if step is None:
            exact += 1
            continue
        top2 = ref.scores[step][0].float().topk(2).values
        gap = float(top2[0] - top2[1])
        print(f"{real.name}: {prompt[:30]!r} diverges at step {step}, transformers' top-2 gap {gap:.4f} nats")
        assert gap < NEAR_TIE, f"{prompt[:40]!r}: diverged at step {step} where the top-2 gap is {gap:.3f} nats"
    assert exact >= len(PROMPTS) - 1, f"only {exact}/{len(PROMPTS)} prompts exact"


def test_tokenizer_matches_transformers_and_every_merge(real: Path, hf: tuple[Any, Any],
                                                       monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The tokenizer converted from the file encodes as transformers' does, on plain, multilingual and code text;
    a SentencePiece vocabulary keeps only the merges BPE can apply (tokenizer._applicable_merges), and it
    encodes exactly as one built with every merge, also on random runs of the file's own pieces."""
    from tests.test_tokenizer import TEXTS
    from tokenmill.model import tokenizer as tokenizer_module

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))  # converted here, not read from a cache
    ours = tokenizer_module.Tokenizer.from_gguf(str(real))
    code = [path.read_text() for path in sorted(Path(tokenizer_module.__file__).parents[1].glob("*/*.py"))[:30]]
    texts = [*TEXTS, *code]
    for text in texts:
        assert ours.encode(text) == hf[1](text).input_ids, f"differs from transformers on {text[:40]!r}"

    reader = GGUFFile(str(real))
    if gguf_field(reader, "tokenizer.ggml.model") != "llama":
        return  # byte-level BPE keeps the file's merges as they are
    tokens = list(gguf_field(reader, "tokenizer.ggml.tokens"))
    rng = random.Random(0)
    pieces = [piece for piece in tokens if len(piece) > 1]
    texts += ["".join(rng.choice(pieces) for _ in range(64)) for _ in range(300)]
    monkeypatch.setattr(tokenizer_module, "_applicable_merges", lambda merges, vocab: merges)
    every_merge = tokenizer_module._gguf_backend(reader, tokens)

    def merge_count(backend: Any) -> int:
        return len(json.loads(backend.to_str())["model"]["merges"])

    assert merge_count(every_merge) > merge_count(ours.backend) > 0
    for text in texts:
        assert ours.backend.encode(text).ids == every_merge.encode(text).ids, f"merges differ on {text[:40]!r}"


QUANTIZED = ("int8", "gguf")  # gguf: the file's blocks executed as stored


def _agreement_and_perplexity(runners: dict[str, ModelRunner], reference: str, sequences: list[list[int]],
                              label: str) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Teacher-forced top-1 agreement of each runner with `reference` over the sequences, each runner's
    perplexity of them, and its mean KL divergence from the reference's next-token distributions."""
    agree = dict.fromkeys(runners, 0)
    nll = dict.fromkeys(runners, 0.0)
    kl = dict.fromkeys(runners, 0.0)
    total = 0
    for ids in sequences:
        logits = {name: runner.prompt_logits(ids).float() for name, runner in runners.items()}
        target = torch.tensor(ids[1:])
        for name, value in logits.items():
            agree[name] += int((logits[reference].argmax(-1) == value.argmax(-1)).sum())
            nll[name] += float(torch.nn.functional.cross_entropy(value[:-1], target, reduction="sum"))
            kl[name] += float(torch.nn.functional.kl_div(value.log_softmax(-1), logits[reference].log_softmax(-1),
                                                         log_target=True, reduction="sum"))
        total += len(ids)
    assert total > 700
    agreement = {name: count / total for name, count in agree.items()}
    ppl = {name: math.exp(value / (total - len(sequences))) for name, value in nll.items()}
    divergence = {name: value / total for name, value in kl.items()}
    print(f"{label}: top-1 agreement with {reference} { {n: round(a, 4) for n, a in agreement.items()} } over "
          f"{total}; perplexity {ppl}; KL { {n: round(d, 5) for n, d in divergence.items()} }")
    return agreement, ppl, divergence


def test_quantized_quality_gate(real: Path, float_llm: LLM, float_outputs: list[Any]) -> None:
    """int8 and the file's own blocks (gguf): teacher-forced top-1 agreement with float32 >= 97% over the
    prompts and their float32 continuations, perplexity of those sequences within +2%."""
    sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in float_outputs]
    loaded = load_model(str(real))
    float_runner = float_llm.engine.core.executor
    assert isinstance(float_runner, ModelRunner)
    runners = {"none": float_runner} | {
        mode: ModelRunner(EngineConfig(num_kv_blocks=64, quantization=mode), loaded.config, loaded.weights)
        for mode in QUANTIZED}
    agreement, ppl, _ = _agreement_and_perplexity(runners, "none", sequences, real.name)
    for mode in QUANTIZED:
        assert agreement[mode] >= 0.97, mode
        assert ppl[mode] <= ppl["none"] * 1.02, mode


KV_8BIT = ("int8", "fp8")


def test_8bit_kv_cache_quality_gate(real: Path, float_outputs: list[Any]) -> None:
    """int8 and fp8 (e4m3) KV caches under the file's own blocks: teacher-forced top-1 agreement with the same
    runner over a bf16 KV cache >= 97%, perplexity within +1% of it. int8's next-token distributions within a
    mean KL of 0.003 of bf16's: the key channel scales' doing (model/key_smoothing.py; without them Qwen2.5's
    outlier key channels cost 0.009)."""
    sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in float_outputs]
    loaded = load_model(str(real))
    runners = {kv: ModelRunner(EngineConfig(num_kv_blocks=64, quantization="gguf", kv_cache_dtype=kv),
                               loaded.config, loaded.weights) for kv in ("bfloat16", *KV_8BIT)}
    agreement, ppl, divergence = _agreement_and_perplexity(runners, "bfloat16", sequences, f"{real.name} KV")
    for kv in KV_8BIT:
        assert agreement[kv] >= 0.97, kv
        assert ppl[kv] <= ppl["bfloat16"] * 1.01, kv
    assert divergence["int8"] <= 0.003


def test_chat_through_the_server(real: Path) -> None:
    from tokenmill.bench.server_process import live_server

    with live_server(str(real)) as server:  # `tokenmill serve MODEL`
        models = httpx.get(server.url + "/v1/models").json()
        reply = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "model": models["data"][0]["id"], "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "system", "content": "Answer briefly."},
                         {"role": "user", "content": "What is the capital of France?"}]})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["choices"][0]["message"]["content"].strip()
    assert body["usage"]["prompt_tokens"] > 10  # the template's turn markers are part of the prompt


def test_lora_adapter_matches_peft(real: Path, hf: tuple[Any, Any], tmp_path: Path) -> None:
    """A rank-8 adapter on every projection of the real file's model (Qwen2's qkv bias and 2 KV heads, Gemma 3's
    norms and windows): greedy tokens in float32 equal PEFT on transformers reading the same file."""
    from peft import PeftModel

    from tokenmill import LoRARequest
    from tokenmill.bench.lora import write_random_adapter

    model, tokenizer = hf
    loaded = load_model(str(real))
    write_random_adapter(tmp_path / "adapter", loaded.config, rank=8, seed=0)
    llm = LLM(str(real), quantization="none", enable_lora=True, max_lora_rank=8, max_num_batched_tokens=256)
    lora = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    prompts = [tokenizer(p).input_ids for p in PROMPTS[:3]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    jobs = [{"prompt_token_ids": p} for p in prompts]
    ours = [list(o.outputs[0].token_ids) for o in llm.generate(jobs, params, lora_request=lora)]
    base = [list(o.outputs[0].token_ids) for o in llm.generate(jobs, params)]
    reference = PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval()
    try:
        reference.generation_config.eos_token_id = None
        with torch.no_grad():
            theirs = [reference.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist()
                      for p in prompts]
    finally:
        reference.unload()  # the module's transformers model serves the other tests without the adapter
    assert ours == theirs
    assert ours != base


def test_qwen_tool_calls_with_the_openai_client() -> None:
    """Qwen2.5-Coder's GGUF template with tools: `required`, a named function and `auto`, plain and streamed, each
    returns tool_calls with parsed arguments (forced calls write Qwen's own <tool_call> token; auto reads the
    tagless JSON this model often writes)."""
    import jsonschema
    import openai

    from tokenmill.bench.server_process import live_server

    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"]}}}
    clock = {"type": "function", "function": {
        "name": "get_time", "description": "Current time in a timezone", "parameters": {
            "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"]}}}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (weather, clock)}
    # the file's own template renders an earlier call that the hermes parser reads back as the same call
    from tokenmill.model.tokenizer import Tokenizer
    from tokenmill.server.tools import prepare_conversation, resolve_parser

    tokenizer = Tokenizer.from_path(str(fetch(QWEN25_CODER_05B)))
    parser = resolve_parser("auto", tokenizer.chat_template)([weather["function"], clock["function"]])
    assert parser.name == "hermes"
    ask = [{"role": "user", "content": "Weather in Lima?"}]
    called = ask + [{"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Lima", "unit": "celsius"}'}}]}]
    tools = [weather["function"], clock["function"]]
    prompt_messages, prompt_extra = prepare_conversation(ask, tools, tokenizer.chat_template, parser)
    prompt = tokenizer.apply_chat_template(prompt_messages, **prompt_extra)
    messages, extra = prepare_conversation(called, tools, tokenizer.chat_template, parser)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False, **extra)
    assert rendered.startswith(prompt) and '"get_time"' in prompt
    turn = rendered[len(prompt):rendered.index("<|im_end|>", len(prompt))]
    content, calls = parser.parse(turn)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Lima", "unit": "celsius"})]
    with live_server(str(fetch(QWEN25_CODER_05B)), "--enable-auto-tool-choice", "--tool-call-parser", "auto",
                     "--max-model-len", "4096") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}, "auto"):
            kwargs: dict[str, Any] = dict(
                model=model, messages=[{"role": "user", "content": "What is the weather in Paris, in celsius?"}],
                tools=[weather, clock], tool_choice=choice, max_tokens=100, temperature=0, parallel_tool_calls=False)
            reply = client.chat.completions.create(**kwargs).choices[0]
            calls = reply.message.tool_calls
            assert calls and len(calls) == 1 and calls[0].function.name == "get_weather", (choice, reply)
            arguments = json.loads(calls[0].function.arguments)
            jsonschema.validate(arguments, schemas["get_weather"])
            assert arguments["city"] == "Paris" and not reply.message.content
            assert reply.finish_reason == ("stop" if isinstance(choice, dict) else "tool_calls")
            streamed: dict[int, dict[str, str]] = {}
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                assert not chunk.choices[0].delta.content
                for delta in chunk.choices[0].delta.tool_calls or []:
                    call = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
            assert list(streamed.values()) == [{"name": "get_weather", "arguments": calls[0].function.arguments}]
