"""Several models in one server (--model-dir, --model NAME=PATH): each loads on its first request, the least
recently used idle one is unloaded past --max-loaded-models, two models answer side by side, an unknown model is a
404, and a model that would not fit in memory is refused with the reason while the loaded ones go on."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.test_tool_calling_families import FAMILIES, write_tiny_gguf
from tokenmill import LLM, SamplingParams
from tokenmill.bench.server_process import live_server

ASK = [{"role": "user", "content": "hi"}]
SMALL = ("--max-model-len", "512", "--kv-cache-memory-gb", "0.05")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("models")
    write_tiny_gguf(directory / "alpha.gguf", *FAMILIES["hermes"])
    write_tiny_gguf(directory / "beta.gguf", *FAMILIES["llama3_json"], seed=1)
    return directory


def _states(url: str) -> dict[str, str]:
    return {card["id"]: card["status"] for card in httpx.get(url + "/v1/models").json()["data"]}


def _expected(path: Path) -> str:
    """The model's own greedy answer, from an engine of its own."""
    llm = LLM(str(path), max_model_len=512, kv_cache_memory_gb=0.05)
    return llm.chat(ASK, SamplingParams(max_tokens=6, temperature=0))[0].outputs[0].text


def test_models_load_on_first_use_and_the_least_recently_used_unloads(model_dir: Path) -> None:
    expected = {name: _expected(model_dir / f"{name}.gguf") for name in ("alpha", "beta")}
    with live_server("--model-dir", str(model_dir), "--max-loaded-models", "1", *SMALL) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        assert _states(server.url) == {"alpha": "on_disk", "beta": "on_disk"}
        for name, after in [("alpha", {"alpha": "loaded", "beta": "on_disk"}),
                            ("beta", {"alpha": "on_disk", "beta": "loaded"}),
                            ("alpha", {"alpha": "loaded", "beta": "on_disk"})]:
            reply = client.chat.completions.create(model=name, messages=ASK, max_tokens=6, temperature=0)
            assert reply.model == name and reply.choices[0].message.content == expected[name]
            assert _states(server.url) == after
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.chat.completions.create(model="gamma", messages=ASK, max_tokens=2)
        missing = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK})
        assert missing.status_code == 400 and "name one in `model`" in missing.text
        metrics = httpx.get(server.url + "/metrics").text
        assert 'tokenmill:generation_tokens_total{model_name="alpha"}' in metrics


def test_two_models_answer_side_by_side(model_dir: Path) -> None:
    models = [f"--model=one={model_dir / 'alpha.gguf'}", f"--model=two={model_dir / 'beta.gguf'}"]
    with live_server(*models, *SMALL) as server:
        results: dict[str, Any] = {}

        def ask(name: str) -> None:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
            chunks = client.chat.completions.create(model=name, messages=ASK, max_tokens=24, temperature=0,
                                                    stream=True)
            results[name] = [c.model for c in chunks]

        threads = [threading.Thread(target=ask, args=(name,)) for name in ("one", "two")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert set(results["one"]) == {"one"} and set(results["two"]) == {"two"}
        assert _states(server.url) == {"one": "loaded", "two": "loaded"}


def test_a_model_that_does_not_fit_is_refused_and_the_others_go_on(model_dir: Path, tmp_path: Path) -> None:
    huge = tmp_path / "huge.gguf"
    with open(huge, "wb") as f:
        f.truncate(2 * 2**40)  # sparse: 2 TiB by its size, nothing on disk
    models = [f"--model=small={model_dir / 'alpha.gguf'}", f"--model=huge={huge}"]
    with live_server(*models, *SMALL) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        assert client.chat.completions.create(model="small", messages=ASK, max_tokens=3).choices
        with pytest.raises(openai.APIStatusError, match="needs about .* GiB .* available: not loaded") as refused:
            client.chat.completions.create(model="huge", messages=ASK, max_tokens=3)
        assert refused.value.status_code == 503
        assert _states(server.url) == {"small": "loaded", "huge": "on_disk"}
        assert client.chat.completions.create(model="small", messages=ASK, max_tokens=3).choices


def _admin(url: str, method: str, path: str, key: str | None = "secret", **kwargs: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, url + path, headers=headers, timeout=120, **kwargs)


def test_a_swap_under_load_loses_nothing_and_failed_swaps_roll_back(model_dir: Path, tmp_path: Path) -> None:
    versions = tmp_path / "versions"
    versions.mkdir()
    write_tiny_gguf(versions / "chat.gguf", *FAMILIES["hermes"])
    write_tiny_gguf(versions / "chat-v2.gguf", *FAMILIES["hermes"])  # the same weights, written again
    write_tiny_gguf(versions / "other.gguf", *FAMILIES["hermes"], seed=5)  # another model
    (versions / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    (versions / "escape.gguf").symlink_to(model_dir / "alpha.gguf")  # points outside the directory
    with live_server("--model-dir", str(versions), "--admin-api-key", "secret", *SMALL) as server:
        url = server.url
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        before = client.chat.completions.create(model="chat", messages=ASK, max_tokens=8, temperature=0)
        # a long stream on version 1 while version 2 takes over
        streamed: list[str] = []
        errors: list[BaseException] = []

        def stream() -> None:
            try:
                for chunk in client.chat.completions.create(model="chat", messages=ASK, max_tokens=400,
                                                            temperature=0, stream=True,
                                                            extra_body={"ignore_eos": True}):
                    streamed.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        thread = threading.Thread(target=stream)
        thread.start()
        while not streamed:
            pass
        swap = _admin(url, "POST", "/admin/models/chat/reload", json={"path": str(versions / "chat-v2.gguf")})
        assert swap.status_code == 200, swap.text
        assert swap.json()["version"] == 2 and swap.json()["agreement"] == 1.0
        after = client.chat.completions.create(model="chat", messages=ASK, max_tokens=8, temperature=0)
        assert after.choices[0].message.content == before.choices[0].message.content
        thread.join(120)
        assert not errors and len(streamed) > 300  # the old version finished its stream
        listing = {m["id"]: m for m in _admin(url, "GET", "/admin/models").json()["data"]}["chat"]
        assert listing["version"] == 2 and listing["path"].endswith("chat-v2.gguf")

        # another model fails the probe, a broken file fails to load: version 2 goes on serving
        for path, reason in [("other.gguf", "probe agreement"), ("broken.gguf", "failed to load")]:
            refused = _admin(url, "POST", "/admin/models/chat/reload", json={"path": str(versions / path)})
            assert refused.status_code == 409 and "rolled back" in refused.text and reason in refused.text
            again = client.chat.completions.create(model="chat", messages=ASK, max_tokens=8, temperature=0)
            assert again.choices[0].message.content == before.choices[0].message.content
        states = [v["state"] for v in {m["id"]: m for m in _admin(url, "GET", "/admin/models").json()[
            "data"]}["chat"]["versions"]]
        assert states[1:] == ["serving", "failed", "failed"] and states[0] in ("draining", "retired")

        # the admin API wants its key; paths outside the directory (a symlink, `..`) are refused
        assert _admin(url, "GET", "/admin/models", key=None).status_code == 401
        assert _admin(url, "GET", "/admin/models", key="wrong").status_code == 401
        for path in [str(versions / "escape.gguf"), str(versions / ".." / "elsewhere.gguf"), "/etc/passwd"]:
            assert _admin(url, "POST", "/admin/models/chat/reload", json={"path": path}).status_code == 403


def test_an_adapter_attaches_to_its_base_model(model_dir: Path, tmp_path: Path, hf_model: Any,
                                               model_path: str) -> None:
    """`--lora-modules` in vLLM's JSON form names the adapter's base model: a request for the adapter loads that
    model and is answered with the adapter on (as an engine of its own answers it), `/v1/models` lists it under
    its parent, and an adapter that names no base (or one not served) is refused at start."""
    import json

    from tests.test_lora import _make_adapter
    from tokenmill.lora.request import LoRARequest
    from tokenmill.server.lora_api import LoRAModule
    from tokenmill.server.model_pool import attach_adapters

    adapter = _make_adapter(hf_model, tmp_path / "pirate", 0, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    llm = LLM(model_path, enable_lora=True, max_lora_rank=8, max_model_len=512, kv_cache_memory_gb=0.05)
    params = SamplingParams(max_tokens=8, temperature=0)
    expected = llm.chat(ASK, params, lora_request=LoRARequest("pirate", 1, str(adapter)))[0].outputs[0].text
    base = llm.chat(ASK, params)[0].outputs[0].text
    assert expected != base  # the adapter changes the answer
    spec = json.dumps({"name": "pirate", "path": str(adapter), "base_model_name": "smol"})
    models = [f"--model=smol={model_path}", f"--model=tiny={model_dir / 'alpha.gguf'}"]
    with live_server(*models, "--enable-lora", "--max-lora-rank", "8", "--lora-modules", spec, *SMALL) as server:
        cards = {card["id"]: card for card in httpx.get(server.url + "/v1/models").json()["data"]}
        assert cards["pirate"]["parent"] == "smol" and cards["pirate"]["status"] == "on_disk"
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(model="pirate", messages=ASK, max_tokens=8, temperature=0)
        assert reply.model == "pirate" and reply.choices[0].message.content == expected
        assert _states(server.url) == {"smol": "loaded", "tiny": "on_disk", "pirate": "loaded"}
        reply = client.chat.completions.create(model="smol", messages=ASK, max_tokens=8, temperature=0)
        assert reply.choices[0].message.content == base
    names = ["smol", "tiny"]
    with pytest.raises(ValueError, match="name the adapter's base model"):
        attach_adapters([LoRAModule("pirate", str(adapter))], names)
    with pytest.raises(ValueError, match="not served"):
        attach_adapters([LoRAModule("pirate", str(adapter), "gone")], names)
    assert attach_adapters([LoRAModule("pirate", str(adapter))], ["smol"]) == {"pirate": "smol"}
