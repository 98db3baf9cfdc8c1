"""Multi-LoRA against PEFT on transformers (float32, the bundled model's weights): each adapter alone, a batch
mixing adapters and the base model, per-adapter prefix caching, slot eviction, the int8 base, and the server's
adapters (listing, selection, run-time load/unload under --lora-dir, errors)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.conftest import LONG_PARAGRAPH
from tests.server_utils import assert_idle_soon, live_server
from tests.test_operations import in_thread, read_sse
from tokenmill import SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.lora.adapter import LoRAError, load_adapter
from tokenmill.lora.request import LoRARequest
from tokenmill.server.metrics import metric_value

NEW_TOKENS = 24
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           LONG_PARAGRAPH * 3 + "In short,"]
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> PEFT LoraConfig arguments: all projections; rsLoRA on a subset of modules and layers; another subset
# with a per-module alpha
ADAPTERS: dict[str, dict[str, Any]] = {
    "all-r8": {"r": 8, "lora_alpha": 16, "target_modules": ALL_MODULES},
    "rslora-r16": {"r": 16, "lora_alpha": 8, "use_rslora": True, "target_modules": ["q_proj", "v_proj", "down_proj"],
                   "layers_to_transform": list(range(0, 30, 2))},
    "mlp-r4": {"r": 4, "lora_alpha": 32, "target_modules": ["o_proj", "gate_proj", "up_proj"],
               "alpha_pattern": {"o_proj": 4}},
}


def _make_adapter(hf_model, directory: Path, seed: int, **config: Any) -> Path:  # noqa: ANN001
    """A PEFT adapter with random A and B (B scaled so that outputs change but stay fluent), saved by PEFT."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "lora_A" in name:
                tensor.normal_(0, tensor.shape[1] ** -0.5)
            elif "lora_B" in name:
                tensor.normal_(0, 0.15 * tensor.shape[1] ** -0.5)
    model.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, hf_model) -> Path:  # noqa: ANN001
    root = tmp_path_factory.mktemp("loras")
    for seed, (name, config) in enumerate(ADAPTERS.items()):
        _make_adapter(hf_model, root / name, seed, **config)
    return root


@pytest.fixture(scope="module")
def lora_requests(adapter_dir: Path) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(adapter_dir / name)) for i, name in enumerate(ADAPTERS)}


def _peft_greedy(hf_model, adapter: Path | None, prompt_ids: list[list[int]]) -> list[list[int]]:  # noqa: ANN001
    from peft import PeftModel

    model = hf_model if adapter is None else PeftModel.from_pretrained(copy.deepcopy(hf_model), str(adapter))
    outputs = []
    with torch.no_grad():
        for ids in prompt_ids:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:  # noqa: ANN001
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def references(hf_model, adapter_dir: Path, prompt_ids) -> dict[str | None, list[list[int]]]:  # noqa: ANN001
    """PEFT's greedy tokens per adapter (None: the base model)."""
    refs: dict[str | None, list[list[int]]] = {None: _peft_greedy(hf_model, None, prompt_ids)}
    for name in ADAPTERS:
        refs[name] = _peft_greedy(hf_model, adapter_dir / name, prompt_ids)
    return refs


def _engine(loaded_model, tokenizer, **overrides: Any) -> LLMEngine:  # noqa: ANN001
    settings: dict[str, Any] = {"quantization": "none", "enable_lora": True, "max_loras": 4, "max_lora_rank": 16,
                                "num_kv_blocks": 400}
    settings.update(overrides)
    return LLMEngine.from_loaded(EngineConfig(**settings), loaded_model, tokenizer)


def _run(engine: LLMEngine, jobs: list[tuple[list[int], LoRARequest | None]],
         params: SamplingParams | None = None) -> list[list[int]]:
    """Submit every job at once (one mixed batch), step to the end; each job's tokens, in order. Nothing leaks."""
    params = params or SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    ids = [engine.add_request(None, {"prompt_token_ids": ids}, params, lora_request=lora) for ids, lora in jobs]
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    engine.core.scheduler.check_integrity()
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks
    return [outputs[i] for i in ids]


def test_references_differ_per_adapter(references) -> None:  # noqa: ANN001
    """The adapters change the model's outputs (else the parity below would prove nothing)."""
    for name in ADAPTERS:
        assert references[name] != references[None], name
    assert len({json.dumps(references[name]) for name in ADAPTERS}) == len(ADAPTERS)


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_each_adapter_alone_matches_peft(loaded_model, tokenizer, prompt_ids, references, lora_requests,
                                         name: str) -> None:  # noqa: ANN001
    engine = _engine(loaded_model, tokenizer)
    for ids, expected in zip(prompt_ids, references[name]):
        assert _run(engine, [(ids, lora_requests[name])]) == [expected]


def test_mixed_batch_gives_each_request_its_own_output(loaded_model, tokenizer, prompt_ids, references,
                                                       lora_requests) -> None:  # noqa: ANN001
    """Three adapters and the base model in one continuous batch, interleaved: each request gets exactly what
    PEFT gives it alone (batch invariance across adapters)."""
    engine = _engine(loaded_model, tokenizer)
    names: list[str | None] = [None, *ADAPTERS]
    jobs = [(ids, None if name is None else lora_requests[name]) for ids in prompt_ids for name in names]
    outputs = _run(engine, jobs)
    expected = [references[name][i] for i in range(len(prompt_ids)) for name in names]
    assert outputs == expected


def test_native_stack_and_layer_path_agree_bit_for_bit(loaded_model, tokenizer, prompt_ids,
                                                       lora_requests) -> None:  # noqa: ANN001
    """int8: the one-call decoder stack adds the deltas exactly as the layer-by-layer path does."""
    engine = _engine(loaded_model, tokenizer, quantization="int8")
    runner = engine.core.executor
    model = runner.model  # type: ignore[attr-defined]
    if model._stack is None:
        pytest.skip("the native decoder stack needs AVX2 or AVX512-VNNI")
    lora = lora_requests["all-r8"]
    stacked = runner.prompt_logits(prompt_ids[-1], lora)  # type: ignore[attr-defined]
    stack, model._stack = model._stack, None
    try:
        layered = runner.prompt_logits(prompt_ids[-1], lora)  # type: ignore[attr-defined]
    finally:
        model._stack = stack
    assert torch.equal(stacked, layered)
    base = runner.prompt_logits(prompt_ids[-1])  # type: ignore[attr-defined]
    assert not torch.equal(stacked, base)


def test_prefix_cache_is_per_adapter(loaded_model, tokenizer, prompt_ids, references,
                                     lora_requests) -> None:  # noqa: ANN001
    engine = _engine(loaded_model, tokenizer)
    kv = engine.core.kv
    prompt = prompt_ids[-1]  # several full blocks
    a, b = lora_requests["all-r8"], lora_requests["mlp-r4"]
    assert _run(engine, [(prompt, a)]) == [references["all-r8"][-1]]
    hits = kv.prefix_hits
    assert _run(engine, [(prompt, b)]) == [references["mlp-r4"][-1]]
    assert kv.prefix_hits == hits, "a prompt under another adapter must not read the first one's KV"
    assert _run(engine, [(prompt, None)]) == [references[None][-1]]
    assert kv.prefix_hits == hits, "nor the base model"
    assert _run(engine, [(prompt, a)]) == [references["all-r8"][-1]]
    assert kv.prefix_hits - hits >= len(prompt) // 16 * 16 - 16, "the same adapter hits its own prefix"


def test_kv_tiers_are_per_adapter(loaded_model, tokenizer, prompt_ids, references,
                                  lora_requests) -> None:  # noqa: ANN001
    """A pool that holds one prompt: adapter b's run pushes a's blocks into the host tier, and b reads none of
    them; a's next run reads its own back and gives peft's tokens."""
    prompt = prompt_ids[-1]
    engine = _engine(loaded_model, tokenizer, num_kv_blocks=len(prompt) // 16 + 4, kv_offload_memory_gb=0.2)
    tiers = engine.core.tiers
    assert tiers is not None
    a, b = lora_requests["all-r8"], lora_requests["mlp-r4"]
    assert _run(engine, [(prompt, a)]) == [references["all-r8"][-1]]
    assert _run(engine, [(prompt, b)]) == [references["mlp-r4"][-1]]
    assert tiers.stats.blocks_saved > 0 and tiers.stats.hits["host"] == 0
    hits = engine.core.kv.prefix_hits
    assert _run(engine, [(prompt, a)]) == [references["all-r8"][-1]]
    assert tiers.stats.hits["host"] > 0  # the pool kept a's first blocks, the tier the rest:
    assert engine.core.kv.prefix_hits - hits >= (len(prompt) - 1) // 16 * 16  # every full block came back


def test_blocks_are_not_shared_between_adapters_in_one_batch(loaded_model, tokenizer, prompt_ids,
                                                             lora_requests) -> None:  # noqa: ANN001
    engine = _engine(loaded_model, tokenizer)
    prompt = prompt_ids[-1]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    first = engine.add_request(None, {"prompt_token_ids": prompt}, params, lora_request=lora_requests["all-r8"])
    second = engine.add_request(None, {"prompt_token_ids": prompt}, params, lora_request=lora_requests["mlp-r4"])
    children = [engine.output_processor.child_ids(r)[0] for r in (first, second)]
    for _ in range(200):  # the adapters are read on a background thread: until both prompts run
        engine.step()
        tables = [set(engine.core.kv.block_table(child)) for child in children]
        if all(tables):
            break
    assert tables[0] and tables[1] and not tables[0] & tables[1]
    while engine.has_unfinished_requests():
        engine.step()


def test_fewer_slots_than_adapters_evicts_and_reloads(loaded_model, tokenizer, prompt_ids, references,
                                                      lora_requests) -> None:  # noqa: ANN001
    """max_loras 1 and a CPU cache of 1: requests for three adapters run one adapter at a time, every adapter is
    read from disk again after eviction, and every output is still PEFT's."""
    engine = _engine(loaded_model, tokenizer, max_loras=1, max_cpu_loras=1)
    lora = engine.core.executor.lora  # type: ignore[attr-defined]
    jobs = [(ids, lora_requests[name]) for name in ADAPTERS for ids in prompt_ids[:2]]
    assert _run(engine, jobs) == [references[name][i] for name in ADAPTERS for i in range(2)]
    # back to the first adapter once the others have pushed it out of its slot and the CPU cache
    assert _run(engine, [(prompt_ids[0], lora_requests["all-r8"])]) == [references["all-r8"][0]]
    assert lora.slots.loads >= len(ADAPTERS) + 1 and lora.cache.disk_loads >= len(ADAPTERS) + 1


def test_max_loras_caps_the_running_adapters(loaded_model, tokenizer, prompt_ids, lora_requests) -> None:  # noqa: ANN001
    engine = _engine(loaded_model, tokenizer, max_loras=2)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    for name in ADAPTERS:
        for ids in prompt_ids[:2]:
            engine.add_request(None, {"prompt_token_ids": ids}, params, lora_request=lora_requests[name])
    engine.add_request(None, {"prompt_token_ids": prompt_ids[0]}, params)  # the base model is never capped
    seen_base = False
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.core.scheduler.running
        assert len({r.lora_request.lora_int_id for r in running if r.lora_request is not None}) <= 2
        seen_base |= any(r.lora_request is None for r in running)
    assert seen_base


def test_speculation_and_structured_outputs_under_an_adapter(loaded_model, tokenizer, prompt_ids, references,
                                                             lora_requests) -> None:  # noqa: ANN001
    from tokenmill.structured_output.params import StructuredOutputsParams

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    engine = _engine(loaded_model, tokenizer, speculative_config=spec)
    names = list(ADAPTERS)
    jobs = [(ids, lora_requests[names[i % len(names)]]) for i, ids in enumerate(prompt_ids)]
    outputs = _run(engine, jobs)
    assert outputs == [references[names[i % len(names)]][i] for i in range(len(prompt_ids))]
    assert engine.core.scheduler.spec.draft_tokens > 0
    choice = SamplingParams(temperature=0.0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]))
    texts = [tokenizer.decode(t) for t in _run(engine, [(prompt_ids[0], lora_requests["all-r8"])], choice)]
    assert texts[0] in ("yes", "no", "maybe")


def test_int8_base_with_adapter_stays_close_to_float32(loaded_model, tokenizer, prompt_ids,
                                                       lora_requests) -> None:  # noqa: ANN001
    """Teacher-forced on float32 + adapter's own greedy continuation: int8 + adapter picks the same top-1 token at
    >= 90% of positions (the int8 base alone scores ~97% against float32 on the quality gate; the random adapters
    here flatten the distribution, so more near-ties)."""
    exact = _engine(loaded_model, tokenizer, num_kv_blocks=64).core.executor
    int8 = _engine(loaded_model, tokenizer, quantization="int8", num_kv_blocks=64).core.executor
    agree = total = 0
    for lora in lora_requests.values():
        for ids in prompt_ids:
            continuation = _run(_engine(loaded_model, tokenizer, num_kv_blocks=64), [(ids, lora)])[0]
            sequence = ids + continuation
            want = exact.prompt_logits(sequence, lora)[len(ids) - 1:].argmax(-1)  # type: ignore[attr-defined]
            got = int8.prompt_logits(sequence, lora)[len(ids) - 1:].argmax(-1)  # type: ignore[attr-defined]
            agree += int((want == got).sum())
            total += want.numel()
    assert agree / total >= 0.90, agree / total


def test_unsupported_adapters_are_refused(hf_model, tmp_path: Path, loaded_model, lora_requests) -> None:  # noqa: ANN001
    config = loaded_model.config
    with pytest.raises(LoRAError, match="exceeds --max-lora-rank"):
        load_adapter(lora_requests["rslora-r16"], config, max_rank=8)
    dora = _make_adapter(hf_model, tmp_path / "dora", 0, r=4, target_modules=["q_proj"], use_dora=True)
    with pytest.raises(LoRAError, match="DoRA"):
        load_adapter(LoRARequest("dora", 9, str(dora)), config, 16)
    saved = _make_adapter(hf_model, tmp_path / "saved", 0, r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    with pytest.raises(LoRAError, match="modules_to_save"):
        load_adapter(LoRARequest("saved", 10, str(saved)), config, 16)
    embed = _make_adapter(hf_model, tmp_path / "embed", 0, r=4, target_modules=["embed_tokens"])
    with pytest.raises(LoRAError, match="embedding"):
        load_adapter(LoRARequest("embed", 11, str(embed)), config, 16)
    with pytest.raises(LoRAError, match="adapter_config.json"):
        load_adapter(LoRARequest("none", 12, str(tmp_path)), config, 16)


def test_engine_without_lora_rejects_adapter_requests(loaded_model, tokenizer, prompt_ids,
                                                      lora_requests) -> None:  # noqa: ANN001
    engine = LLMEngine.from_loaded(EngineConfig(quantization="none", num_kv_blocks=64), loaded_model, tokenizer)
    with pytest.raises(ValueError, match="--enable-lora"):
        engine.add_request(None, {"prompt_token_ids": prompt_ids[0]}, SamplingParams(max_tokens=2),
                           lora_request=lora_requests["all-r8"])


def test_adapter_that_fails_to_load_fails_only_its_requests(loaded_model, tokenizer, prompt_ids, references,
                                                             tmp_path: Path) -> None:  # noqa: ANN001
    engine = _engine(loaded_model, tokenizer)
    missing = LoRARequest("missing", 50, str(tmp_path / "nowhere"))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    bad = engine.add_request(None, {"prompt_token_ids": prompt_ids[0]}, params, lora_request=missing)
    good = engine.add_request(None, {"prompt_token_ids": prompt_ids[0]}, params)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
    assert finished[bad].finish_reason == "abort"
    assert finished[good].token_ids == references[None][0]
    engine.core.scheduler.check_integrity()
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks


# ------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def lora_server(adapter_dir: Path, tmp_path_factory):  # noqa: ANN001, ANN201
    allowed = tmp_path_factory.mktemp("lora-dir")
    shutil.copytree(adapter_dir / "rslora-r16", allowed / "late")
    with live_server("--quantization", "none", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                     "--lora-modules", f"all-r8={adapter_dir / 'all-r8'}",
                     json.dumps({"name": "mlp-r4", "path": str(adapter_dir / "mlp-r4")}),
                     "--enable-runtime-lora-updating", "--lora-dir", str(allowed)) as server:
        yield server.url, adapter_dir


def test_server_lists_and_serves_adapters(lora_server, prompt_ids, references) -> None:  # noqa: ANN001
    url, _ = lora_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    models = {m.id: m for m in client.models.list().data}
    base = next(name for name, m in models.items() if getattr(m, "parent", None) is None)
    assert {"all-r8", "mlp-r4"} <= set(models) and models["all-r8"].parent == base  # type: ignore[attr-defined]
    for name in (base, "all-r8", "mlp-r4"):
        out = client.completions.create(model=name, prompt=prompt_ids[0], max_tokens=NEW_TOKENS, temperature=0,
                                        extra_body={"min_tokens": NEW_TOKENS})
        assert out.model == name
        assert out.choices[0].text == _decode(url, references[None if name == base else name][0])
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
    lines = httpx.get(url + "/metrics").text.splitlines()
    assert any(line.startswith("tokenmill:lora_requests_total{") and 'lora_name="all-r8"' in line
               and line.endswith(" 1.0") for line in lines)
    assert any(line.startswith("tokenmill:lora_requests_info{") and 'max_lora="2"' in line for line in lines)
    assert_idle_soon(url)


def _decode(url: str, token_ids: list[int]) -> str:
    return httpx.post(url + "/detokenize", json={"tokens": token_ids}).json()["prompt"]


def test_runtime_load_and_unload_stay_inside_lora_dir(lora_server, prompt_ids, references) -> None:  # noqa: ANN001
    url, adapter_dir = lora_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    outside = httpx.post(url + "/v1/load_lora_adapter",
                         json={"lora_name": "escape", "lora_path": str(adapter_dir / "rslora-r16")})
    assert outside.status_code == 403 and "lora-dir" in outside.json()["error"]["message"]
    dotdot = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "escape", "lora_path": "../x"})
    assert dotdot.status_code == 403
    loaded = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": "late"})
    assert loaded.status_code == 200, loaded.text
    again = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": "late"})
    assert again.status_code == 400 and "already" in again.json()["error"]["message"]
    out = client.completions.create(model="late", prompt=prompt_ids[1], max_tokens=NEW_TOKENS, temperature=0,
                                    extra_body={"min_tokens": NEW_TOKENS})
    assert out.choices[0].text == _decode(url, references["rslora-r16"][1])
    chat = client.chat.completions.create(model="late", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.model == "late"
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt="hi", max_tokens=2)
    gone = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"
    assert_idle_soon(url)


def test_an_adapter_s_stream_continues_exactly_after_its_core_is_killed(lora_server) -> None:  # noqa: ANN001
    """Migration keeps the adapter: the restarted core loads it and the stream goes on token for token."""
    url, _ = lora_server
    body = {"model": "all-r8", "prompt": "Tell me about the sea", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0}
    undisturbed: list[Any] = []
    read_sse(url, body, undisturbed, threading.Event())
    events: list[Any] = []
    started = threading.Event()
    thread = in_thread(read_sse, url, body, events, started)
    assert started.wait(60)
    while len(events) < 10:
        time.sleep(0.05)
    os.kill(httpx.get(url + "/health").json()["replicas"][0]["pid"], signal.SIGKILL)
    thread.join(240)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events if isinstance(e, dict)), events[-3:]

    def text(stream: list[Any]) -> str:
        return "".join(e["choices"][0]["text"] for e in stream if isinstance(e, dict))

    assert text(events) == text(undisturbed) and len(text(events)) > 0
    assert metric_value(httpx.get(url + "/metrics").text, "tokenmill:request_migrations_total") == 1.0



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_lora_kernel_matches_torch_and_is_batch_invariant(loaded_model, dtype: torch.dtype) -> None:  # noqa: ANN001
    """kernels/lora.c against the float64 product of the stored weights, over slots of different ranks and rows
    in any grouping; a row computed alone is bit-identical to the same row inside a batch."""
    from tokenmill import kernels
    from tokenmill.lora.adapter import LoRAAdapter
    from tokenmill.lora.slots import LoRABatch, ProjectionLoRA

    if not kernels.lora_add_supported(torch.empty(1)):
        pytest.skip("no C compiler")
    config = loaded_model.config
    projection = ProjectionLoRA(["q", "k", "v"], config, num_slots=3, max_rank=20, device=torch.device("cpu"),
                                dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    ranks = {0: 20, 1: 3, 2: 9}
    for slot, rank in ranks.items():
        parts = {(0, p): (torch.randn(rank, config.hidden_size, generator=generator),
                          torch.randn(rank, w, generator=generator))
                 for p, w in (("q", 576), ("k", 192), ("v", 192)) if not (slot == 1 and p == "k")}
        projection.fill(slot, 0, LoRAAdapter(LoRARequest(f"s{slot}", slot + 1, "."), rank, parts))
    rows = 37
    x = torch.randn(rows, config.hidden_size, generator=generator)
    row_slots = torch.randint(-1, 3, (rows,), generator=generator).numpy()
    batch = LoRABatch.from_row_slots(row_slots)
    assert batch is not None
    y = torch.randn(rows, 960, generator=generator)
    expected = y.double().clone()
    for t in range(rows):
        slot = int(row_slots[t])
        for i, (offset, width) in enumerate(zip(projection.offset, projection.width)):
            rank = int(projection.ranks[i, slot]) if slot >= 0 else 0
            if rank:
                at, bt = projection.at[i][slot, :, :rank].double(), projection.bt[i][slot, :rank].double()
                expected[t, offset:offset + width] += x[t].double() @ at @ bt
    native = y.clone()
    projection.add(x, native, batch)
    assert torch.allclose(native.double(), expected, rtol=1e-4, atol=1e-3)
    for t in (0, 5, rows - 1):  # alone: the same bits
        alone = y[t:t + 1].clone()
        single = LoRABatch.from_row_slots(row_slots[t:t + 1])
        if single is not None:
            projection.add(x[t:t + 1], alone, single)
        assert torch.equal(alone[0], native[t])
