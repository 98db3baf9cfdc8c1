"""Embeddings, reranking and scores (tokenmill/encoder/, server/embeddings_api.py): tiny random BERT, nomic-bert
and cross-encoder models against transformers float32, a GGUF written as llama.cpp's converter writes BERT,
the real nomic-embed-text-v1.5 file against transformers on its weights and on a small retrieval set, and the
HTTP API through the official openai client."""

from __future__ import annotations

import base64
import json
import random
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.real_models import NOMIC_EMBED_V15, fetch
from tokenmill import LLM
from tokenmill.config import EngineConfig
from tokenmill.encoder.engine import EmbeddingEngine

WORDS = ["the", "cat", "dog", "sat", "on", "mat", "run", "fast", "slow", "blue", "red", "house", "tree"]
VOCAB = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [chr(c) for c in range(97, 123)]
         + ["##" + chr(c) for c in range(97, 123)] + WORDS + ["##ing", ".", ",", "?"])
TEXTS = ["the cat sat on the mat", "dogs", "the dog sat on the cats mat, and the cat sat.",
         "running fast? the red house", "a " * 40 + "tree"]


def _tiny(kind: str, directory: Path) -> tuple[Any, Any]:
    """A random tiny model of `kind` (bert, nomic, cross) saved with its tokenizer into `directory`."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        BertModel,
        BertTokenizerFast,
        NomicBertConfig,
        NomicBertModel,
    )

    torch.manual_seed({"bert": 0, "nomic": 1, "cross": 2}[kind])
    shape = {"vocab_size": len(VOCAB), "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 96, "max_position_embeddings": 128}
    if kind == "nomic":
        model = NomicBertModel(NomicBertConfig(**shape))
    elif kind == "cross":
        model = BertForSequenceClassification(BertConfig(**shape, num_labels=1))
    else:
        model = BertModel(BertConfig(**shape))
    with torch.no_grad():  # LayerNorm weights away from their init values, so a swapped one shows
        for name, parameter in model.named_parameters():
            if "LayerNorm" in name or "layernorm" in name or "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_text("\n".join(VOCAB))
    tokenizer = BertTokenizerFast(vocab={token: i for i, token in enumerate(VOCAB)})
    assert tokenizer("the cats")["input_ids"] == [2, VOCAB.index("the"), VOCAB.index("cat"), VOCAB.index("##s"), 3]
    model.eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model, tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any, Any]]:
    root = tmp_path_factory.mktemp("encoders")
    return {kind: (root / kind, *_tiny(kind, root / kind)) for kind in ("bert", "nomic", "cross")}


def _reference(model: Any, tokenizer: Any, text: str, pooling: str) -> torch.Tensor:
    encoded = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**encoded).last_hidden_state[0]
    return hidden[0] if pooling == "cls" else hidden.mean(0)


@pytest.mark.parametrize("kind", ["bert", "nomic"])
@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_tiny_encoders_match_transformers_alone_and_batched(tiny: dict[str, Any], kind: str, pooling: str) -> None:
    path, model, tokenizer = tiny[kind]
    engine = EmbeddingEngine(EngineConfig(model=str(path), quantization="none",
                                          pooler_config={"pooling_type": pooling.upper(), "normalize": False}))
    try:
        batched = engine.embed(TEXTS)
        for text, row in zip(TEXTS, batched, strict=True):
            alone = engine.embed([text])[0]
            expected = _reference(model, tokenizer, text, pooling)
            for ours in (alone, row):
                assert F.cosine_similarity(ours, expected, dim=0) >= 0.99999
                assert torch.allclose(ours, expected, atol=1e-4)
    finally:
        engine.shutdown()


def test_a_cross_encoder_scores_pairs_as_transformers(tiny: dict[str, Any]) -> None:
    path, model, tokenizer = tiny["cross"]
    llm = LLM(str(path), task="embed", quantization="none")
    query, documents = "the cat", ["the cat sat on the mat", "a blue tree", "dogs run fast"]
    scores = [o.outputs.score for o in llm.score(query, documents)]
    with torch.no_grad():
        logits = model(**tokenizer([query] * 3, documents, return_tensors="pt", padding=True)).logits[:, 0]
    assert np.allclose(scores, torch.sigmoid(logits).tolist(), atol=1e-5)
    with pytest.raises(ValueError, match="generates"):
        LLM().embed("hello")  # the bundled model generates
    with pytest.raises(ValueError, match="task embed"):
        LLM(str(path), task="generate")
    llm.close()


def _write_bert_gguf(path: Path, directory: Path, model: Any) -> None:
    """The tiny BERT as llama.cpp's converter writes one: phantom-space vocabulary ("##x" -> "x", "x" -> "▁x",
    specials as they are), its tensor names, mean pooling (a cross-encoder: its head as `cls` and `cls.output`,
    rank pooling)."""
    import gguf

    from tests.test_families import _finish

    writer = gguf.GGUFWriter(str(path), "bert")
    config = model.config
    cross = hasattr(model, "classifier")
    state = model.state_dict()
    if cross:
        state = {k.removeprefix("bert."): v for k, v in state.items()}
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_layer_norm_eps(config.layer_norm_eps)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.RANK if cross else gguf.PoolingType.MEAN)
    tokens = [t if t.startswith("[") else t[2:] if t.startswith("##") else "\u2581" + t for t in VOCAB]
    writer.add_tokenizer_model("bert")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("[") else 1 for t in VOCAB])
    writer.add_token_type_count(2)
    for key, token in (("unk", "[UNK]"), ("bos", "[CLS]"), ("sep", "[SEP]"), ("pad", "[PAD]")):
        getattr(writer, f"add_{key}_token_id")(VOCAB.index(token))
    names = {"embeddings.word_embeddings.weight": "token_embd.weight",
             "embeddings.position_embeddings.weight": "position_embd.weight",
             "embeddings.token_type_embeddings.weight": "token_types.weight",
             "embeddings.LayerNorm.weight": "token_embd_norm.weight",
             "embeddings.LayerNorm.bias": "token_embd_norm.bias"}
    if cross:
        names |= {"pooler.dense.weight": "cls.weight", "pooler.dense.bias": "cls.bias",
                  "classifier.weight": "cls.output.weight", "classifier.bias": "cls.output.bias"}
    layer_names = {"attention.self.query": "attn_q", "attention.self.key": "attn_k",
                   "attention.self.value": "attn_v", "attention.output.dense": "attn_output",
                   "attention.output.LayerNorm": "attn_output_norm", "intermediate.dense": "ffn_up",
                   "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm"}
    for name, tensor in state.items():
        if name.startswith("encoder.layer."):
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{layer_names[module]}.{kind}"
        elif name in names:
            gguf_name = names[name]
        else:
            continue  # the next-sentence pooler
        wide = tensor.dim() == 2 and "embd" not in gguf_name and "cls" not in gguf_name
        array = tensor.numpy().astype(np.float16 if wide else np.float32)
        writer.add_tensor(gguf_name, array)
    _finish(writer)


def test_a_bert_gguf_reads_as_its_hf_directory(tiny: dict[str, Any], tmp_path: Path) -> None:
    """llama.cpp's BERT layout: the vocabulary's phantom spaces undone tokenize as the original WordPiece, and
    the f16 weights give the HF model's embeddings (to f16's precision)."""
    directory, model, tokenizer = tiny["bert"]
    gguf_path = tmp_path / "tiny-bert.gguf"
    _write_bert_gguf(gguf_path, directory, model)
    engine = EmbeddingEngine(EngineConfig(model=str(gguf_path), quantization="none"))
    try:
        assert engine.pooling == "mean" and engine.normalize
        for text in [*TEXTS, "The CAT, running?", "unknownword zzz", "cats and dogs"]:
            assert engine.make_input(text).token_ids == tokenizer(text)["input_ids"]
        vectors = engine.embed(TEXTS)
        for text, ours in zip(TEXTS, vectors, strict=True):
            expected = F.normalize(_reference(model, tokenizer, text, "mean"), dim=0)
            assert F.cosine_similarity(ours, expected, dim=0) >= 0.9999
    finally:
        engine.shutdown()

    # a cross-encoder (rank pooling, its head as cls / cls.output): scores as transformers'
    directory, cross, tokenizer = tiny["cross"]
    _write_bert_gguf(tmp_path / "tiny-reranker.gguf", directory, cross)
    llm = LLM(str(tmp_path / "tiny-reranker.gguf"), quantization="none")
    query, documents = "the cat", ["the cat sat on the mat", "a blue tree"]
    with torch.no_grad():
        logits = cross(**tokenizer([query] * 2, documents, return_tensors="pt", padding=True)).logits[:, 0]
    scores = [o.outputs.score for o in llm.score(query, documents)]
    assert np.allclose(scores, torch.sigmoid(logits).tolist(), atol=1e-3)  # f16 weights
    llm.close()


# ---------------------------------------------------------------- the real nomic-embed-text-v1.5 file


@pytest.fixture(scope="module")
def nomic() -> Path:
    return fetch(NOMIC_EMBED_V15)


def _transformers_nomic(path: Path) -> Any:
    """transformers' NomicBertModel on the GGUF's tensors (read with the gguf package, named by hand)."""
    from gguf import GGUFReader
    from transformers import NomicBertConfig, NomicBertModel

    reader = GGUFReader(str(path))
    tensors = {t.name: torch.from_numpy(np.array(t.data, dtype=np.float32)) for t in reader.tensors}
    layers = 1 + max(int(name.split(".")[1]) for name in tensors if name.startswith("blk."))
    config = NomicBertConfig(vocab_size=tensors["token_embd.weight"].shape[0], hidden_size=768,
                             num_hidden_layers=layers, num_attention_heads=12, intermediate_size=3072,
                             max_position_embeddings=2048, layer_norm_eps=1e-12,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    state = {"embeddings.word_embeddings.weight": tensors["token_embd.weight"],
             "embeddings.token_type_embeddings.weight": tensors["token_types.weight"],
             "embeddings.LayerNorm.weight": tensors["token_embd_norm.weight"],
             "embeddings.LayerNorm.bias": tensors["token_embd_norm.bias"]}
    for i in range(layers):
        q, k, v = tensors[f"blk.{i}.attn_qkv.weight"].chunk(3)
        prefix = f"layers.{i}."
        state |= {prefix + "self_attn.q_proj.weight": q, prefix + "self_attn.k_proj.weight": k,
                  prefix + "self_attn.v_proj.weight": v,
                  prefix + "self_attn.o_proj.weight": tensors[f"blk.{i}.attn_output.weight"],
                  prefix + "mlp.up_proj.weight": tensors[f"blk.{i}.ffn_up.weight"],
                  prefix + "mlp.gate_proj.weight": tensors[f"blk.{i}.ffn_gate.weight"],
                  prefix + "mlp.down_proj.weight": tensors[f"blk.{i}.ffn_down.weight"]}
        for ours, theirs in (("attn_output_norm", "post_attention_layernorm"), ("layer_output_norm",
                                                                                "post_mlp_layernorm")):
            state[prefix + theirs + ".weight"] = tensors[f"blk.{i}.{ours}.weight"]
            state[prefix + theirs + ".bias"] = tensors[f"blk.{i}.{ours}.bias"]
    model = NomicBertModel(config).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("position_ids" in m or "token_type_ids" in m for m in missing), missing
    return model


NOMIC_TEXTS = ["search_query: What is TSNE?",
               "search_document: t-SNE is a statistical method for visualizing high-dimensional data.",
               "search_document: Le café était délicieux, n'est-ce pas?",
               "search_query: " + "The quick brown fox jumps over the lazy dog. " * 30]


def test_nomic_embed_matches_transformers_on_its_weights(nomic: Path) -> None:
    """float32: transformers' forward on the same tensors, mean-pooled (the file's pooling) and normalised; the
    default linears (bf16 where the CPU has it) within cosine 0.9999 of it."""
    reference_model = _transformers_nomic(nomic)
    exact = LLM(str(nomic), quantization="none")
    default = LLM(str(nomic))
    assert exact.embedder is not None
    inputs = [exact.embedder.make_input(t) for t in NOMIC_TEXTS]
    with torch.no_grad():
        expected = torch.stack([
            F.normalize(reference_model(input_ids=torch.tensor([i.token_ids])).last_hidden_state[0].mean(0), dim=0)
            for i in inputs])
    for llm, threshold in ((exact, 0.999999), (default, 0.9999)):
        vectors = torch.tensor([o.outputs.embedding for o in llm.embed(NOMIC_TEXTS)])
        similarity = F.cosine_similarity(vectors, expected)
        assert similarity.min() >= threshold, similarity
    # matryoshka: the file does not say, the operator does (vLLM's --hf-overrides)
    with pytest.raises(ValueError, match="matryoshka"):
        exact.embed(NOMIC_TEXTS[:1], dimensions=256)
    exact.close()
    default.close()
    truncating = LLM(str(nomic), quantization="none", hf_overrides={"matryoshka_dimensions": [768, 512, 256]})
    [short] = truncating.embed(NOMIC_TEXTS[:1], dimensions=256)
    assert len(short.outputs.embedding) == 256
    assert np.allclose(short.outputs.embedding, F.normalize(expected[0, :256], dim=0).tolist(), atol=1e-4)
    truncating.close()


def _retrieval_set() -> dict[str, Any]:
    return json.loads((Path(__file__).parent / "data" / "retrieval_small.json").read_text())


def test_nomic_retrieves_and_reranks_through_the_openai_client(nomic: Path) -> None:
    """20 queries x 100 passages: recall@5 of the real model through /v1/embeddings (the official openai client,
    float and base64), and /rerank ranks as the cosine of those embeddings; bad input gets a 400."""
    import openai

    from tests.server_utils import live_server

    data = _retrieval_set()
    passages = ["search_document: " + p for p in data["passages"]]
    with live_server("--model", str(nomic)) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        floats = client.embeddings.create(model=model, input=passages, encoding_format="float")
        assert floats.usage.prompt_tokens > 100 * 5
        documents = torch.tensor([d.embedding for d in floats.data])
        raw = http.post("/v1/embeddings",
                         json={"model": model, "input": passages[:3], "encoding_format": "base64"}).json()
        decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]]
        assert np.allclose(np.stack(decoded), documents[:3].numpy(), atol=1e-6)
        through_client = client.embeddings.create(model=model, input=passages[:3])  # the client's base64
        assert np.allclose([d.embedding for d in through_client.data], documents[:3].numpy(), atol=1e-6)

        hits = 0
        hits_seen: list[int] = []
        for item in data["queries"]:
            query = "search_query: " + item["query"]
            vector = torch.tensor(client.embeddings.create(model=model, input=query).data[0].embedding)
            cosine = documents @ vector
            top = cosine.topk(5).indices.tolist()
            hits += item["relevant"] in top
            # rerank a candidate list (the 10 nearest and 10 others, shuffled): the same order as the cosine
            candidates = cosine.argsort(descending=True)[:10].tolist() + list(range(0, 100, 10))
            candidates = list(dict.fromkeys(candidates))
            random.Random(len(hits_seen)).shuffle(candidates)
            hits_seen.append(item["relevant"])
            reranked = http.post("/rerank", json={"model": model, "query": query, "top_n": 5,
                                                  "documents": [passages[c] for c in candidates]}).json()
            assert [candidates[r["index"]] for r in reranked["results"]] == top
            assert reranked["results"][0]["document"]["text"] == passages[top[0]]
            assert abs(reranked["results"][0]["relevance_score"] - cosine[top[0]].item()) < 1e-4
        assert hits / len(data["queries"]) >= 0.9, hits

        scored = http.post("/score", json={"model": model, "text_1": passages[0],
                                                         "text_2": [passages[0], passages[1]]}).json()
        assert scored["data"][0]["score"] == pytest.approx(1.0, abs=1e-4)
        assert scored["data"][1]["score"] == pytest.approx((documents[0] @ documents[1]).item(), abs=1e-4)

        def status(path: str, body: dict[str, Any]) -> tuple[int, str]:
            reply = http.post(path, json={"model": model, **body})
            return reply.status_code, reply.json()["error"]["message"] if reply.status_code != 200 else ""

        assert status("/v1/embeddings", {"input": []})[0] == 400
        assert status("/v1/embeddings", {"input": ""}) == (400, "an input is an empty string")
        assert status("/v1/embeddings", {"input": 5})[0] == 400
        assert status("/v1/embeddings", {"input": [[1, 2], "x"]})[0] == 400
        code, message = status("/v1/embeddings", {"input": "word " * 3000})
        assert code == 400 and "maximum of 2048" in message
        long = client.embeddings.create(model=model, input="word " * 3000,
                                        extra_body={"truncate_prompt_tokens": 100})
        assert long.usage.prompt_tokens == 100
        assert status("/v1/embeddings", {"input": "x", "dimensions": 64})[0] == 400
        assert status("/v1/embeddings", {"input": [10**7]})[0] == 400
        assert status("/rerank", {"query": "q", "documents": []})[0] == 400
        assert status("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})[0] == 400
        code, message = status("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert code == 400 and "--task embed" in message
        assert client.embeddings.create(model=model, input="still serving").data  # nothing broke


def test_a_generative_server_refuses_embeddings() -> None:
    from tests.server_utils import live_server

    with live_server() as server:
        reply = httpx.post(server.url + "/v1/embeddings", json={"input": "hello"})
        assert reply.status_code == 400 and "--task embed" in reply.json()["error"]["message"]


# ---------------------------------------------------------------- a decoder with task "embed"


def test_a_decoder_embeds_its_last_token_through_the_scheduler(tmp_path: Path) -> None:
    """Qwen3 with task "embed" (Qwen3-Embedding's pooling): each prompt a request through the scheduler, its
    chunks under the token budget, the final hidden state after its last token, as transformers' Qwen3Model; the
    same alone, batched, chunked and from the prefix cache."""
    from tests.test_families import _prompts, _tiny_model

    model = _tiny_model("qwen3", tmp_path)
    prompts = _prompts()
    with torch.no_grad():
        expected = [F.normalize(model.model(torch.tensor([p])).last_hidden_state[0, -1], dim=0) for p in prompts]
    llm = LLM(str(tmp_path), task="embed", quantization="none", max_num_batched_tokens=16)  # 70 tokens: 5 chunks
    batched = [o.outputs.embedding for o in llm.embed(prompts)]
    again = [o.outputs.embedding for o in llm.embed(prompts)]  # their prefixes now come from the cache
    alone = [llm.embed(p)[0].outputs.embedding for p in prompts]
    for vectors in (batched, again, alone):
        for ours, reference in zip(vectors, expected, strict=True):
            assert F.cosine_similarity(torch.tensor(ours), reference, dim=0) >= 0.99999
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks  # nothing held after
    scores = [o.outputs.score for o in llm.score(prompts[0], prompts[:2])]  # type: ignore[arg-type]
    assert scores[0] == pytest.approx(1.0, abs=1e-5)
    assert scores[1] == pytest.approx(float(expected[0] @ expected[1]), abs=1e-5)
    with pytest.raises(ValueError, match="last-token"):
        LLM(str(tmp_path), task="embed", pooler_config={"pooling_type": "MEAN"})


def test_a_decoder_serves_embeddings_through_its_engine_cores(tmp_path: Path) -> None:
    """`tokenmill serve QWEN3_DIR --task embed`: /v1/embeddings through the engine-core processes (the official
    client), equal to the offline engine's; generation is refused there with a 400."""
    import openai

    from tests.server_utils import live_server
    from tests.test_families import _tiny_model

    _tiny_model("qwen3", tmp_path)
    texts = ["w5 w6 w7 w8", "w9 " * 40 + "w10"]
    offline = LLM(str(tmp_path), task="embed", quantization="none")
    expected = [o.outputs.embedding for o in offline.embed(texts)]
    with live_server("--model", str(tmp_path), "--task", "embed", "--quantization", "none") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        reply = client.embeddings.create(model=client.models.list().data[0].id, input=texts)
        assert reply.usage.prompt_tokens == 4 + 41
        for ours, reference in zip(reply.data, expected, strict=True):
            assert np.allclose(ours.embedding, reference, atol=1e-5)
        chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert chat.status_code == 400 and "--task embed" in chat.json()["error"]["message"]
        bad = httpx.post(server.url + "/v1/embeddings", json={"input": ["w5", ""]})
        assert bad.status_code == 400


def test_serve_refuses_what_an_encoder_server_cannot_do(tiny: dict[str, Any]) -> None:
    import subprocess
    import sys

    path = str(tiny["bert"][0])
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", path, "--enable-lora"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--enable-lora" in done.stderr and "encoder" in done.stderr


def test_encoders_serve_through_engine_core_processes(tiny: dict[str, Any]) -> None:
    """`tokenmill serve ENCODER`: inputs go to engine-core processes (two replicas here) whose schedulers run
    them; the vectors equal the offline engine's, a cross-encoder's pairs keep their token types, and the
    engine's own metrics count the work."""
    from tests.server_utils import live_server

    bert, cross = str(tiny["bert"][0]), str(tiny["cross"][0])
    offline = EmbeddingEngine(EngineConfig(model=bert, quantization="none"))
    expected = offline.embed(TEXTS)
    with_specials = offline.make_input("the cat").token_ids
    offline.shutdown()
    query, documents = "the cat", ["the cat sat on the mat", "a blue tree", "dogs run fast"]
    reference = LLM(cross, task="embed", quantization="none")
    scores = [o.outputs.score for o in reference.score(query, documents)]
    reference.close()
    with live_server("--model", bert, "--quantization", "none", "--data-parallel-size", "2") as server:
        reply = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS}, timeout=60).json()
        assert [d["index"] for d in reply["data"]] == list(range(len(TEXTS)))
        for ours, reference in zip(reply["data"], expected, strict=True):
            assert np.allclose(ours["embedding"], reference.numpy(), atol=1e-5)
        metrics = httpx.get(server.url + "/metrics").text
        prompt_tokens = sum(float(line.split()[-1]) for line in metrics.splitlines()
                            if line.startswith("tokenmill:prompt_tokens_total"))
        assert prompt_tokens == reply["usage"]["prompt_tokens"]
        tokenized = httpx.post(server.url + "/tokenize", json={"prompt": "the cat"}).json()
        assert tokenized["tokens"] == with_specials  # [CLS] the cat [SEP], as the model reads it
        # a core SIGKILLed under load: its inputs move to the other replica and the answer is whole and exact
        import os
        import signal
        import threading

        many = [TEXTS[i % len(TEXTS)] + " " + WORDS[i % len(WORDS)] * (1 + i % 7) for i in range(3000)]
        answer: dict[str, Any] = {}
        sending = threading.Thread(target=lambda: answer.update(httpx.post(
            server.url + "/v1/embeddings", json={"input": many}, timeout=300).json()))
        sending.start()
        deadline = time.monotonic() + 60
        while sum(float(line.split()[-1]) for line in httpx.get(server.url + "/metrics").text.splitlines()
                  if line.startswith("tokenmill:prompt_tokens_total")) <= prompt_tokens:  # none of them done yet
            assert time.monotonic() < deadline and sending.is_alive(), "the inputs never ran"
            time.sleep(0.02)
        os.kill(httpx.get(server.url + "/health").json()["replicas"][0]["pid"], signal.SIGKILL)
        sending.join(300)
        moved = sum(float(line.split()[-1]) for line in httpx.get(server.url + "/metrics").text.splitlines()
                    if line.startswith("tokenmill:request_migrations_total"))
        assert moved > 0, ("the kill came after the work: nothing to move", str(answer)[:300])
        engine = EmbeddingEngine(EngineConfig(model=bert, quantization="none"))
        reference = engine.embed(many)
        engine.shutdown()
        assert len(answer["data"]) == len(many)
        assert np.allclose([d["embedding"] for d in answer["data"]], reference.numpy(), atol=1e-5)
    with live_server("--model", cross, "--quantization", "none") as server:
        reranked = httpx.post(server.url + "/rerank", json={"query": query, "documents": documents}).json()
        by_index = {r["index"]: r["relevance_score"] for r in reranked["results"]}
        assert np.allclose([by_index[i] for i in range(3)], scores, atol=1e-5)
