"""The OpenAI-compatible server, live on loopback with the bundled model, driven by the official client."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest

from tests.server_utils import live_server
from tokenmill.server.metrics import metric_value

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def stream_text(stream) -> tuple[str, list]:  # noqa: ANN001
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks


# ------------------------------------------------------------------ 1. the official client


def test_models_and_health(client: openai.OpenAI, base_url: str) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(base_url + "/health").json()
    assert health["status"] == "ok" and [r["state"] for r in health["replicas"]] == ["up"]


def test_completion_greedy_stream_equals_non_stream_and_usage(client: openai.OpenAI, tokenizer) -> None:  # noqa: ANN001
    prompt = "The three primary colors are"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.object == "text_completion"
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert full.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert full.usage.completion_tokens == 24
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24
    text, chunks = stream_text(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert text == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name a fruit that is yellow."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    assert full.object == "chat.completion"
    message = full.choices[0].message
    assert message.role == "assistant" and message.content
    assert full.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_stop_strings_cut_the_text_in_both_modes(client: openai.OpenAI) -> None:
    prompt = "Count: one, two, three, four, five, six, seven,"
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0).choices[0].text
    assert "," in base[1:]
    stop = ","
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[stop])
    choice = full.choices[0]
    assert choice.finish_reason == "stop" and stop not in choice.text
    assert base.startswith(choice.text) and base[len(choice.text)] == stop
    text, _ = stream_text(client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0,
                                                    stop=[stop], stream=True))
    assert text == choice.text


def test_n_choices_and_seed(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="My favourite animal is", max_tokens=12, temperature=1.0, n=3, seed=123)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1  # the samples differ from each other
    assert first.usage.completion_tokens == sum(
        len(c.logprobs.tokens) if c.logprobs else 0 for c in first.choices) or first.usage.completion_tokens > 0
    other = client.completions.create(**{**kwargs, "seed": 124})
    assert [c.text for c in other.choices] != [c.text for c in first.choices]
    texts, _ = stream_text(client.completions.create(**{**kwargs, "n": 1}, stream=True))
    assert texts == client.completions.create(**{**kwargs, "n": 1}).choices[0].text


def test_logprobs_completion_and_chat(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=6, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) == 3
        assert max(top.values()) == pytest.approx(value)  # greedy: the chosen token is the most likely
        assert token in top
    assert "".join(lp.tokens) == out.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


def test_priority_and_token_id_prompts(client: openai.OpenAI, tokenizer) -> None:  # noqa: ANN001
    ids = tokenizer.encode("The capital of France is")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0,
                                       extra_body={"priority": 3})
    by_text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=MODEL, prompt=["One", "Two"], max_tokens=3, temperature=0)
    assert sorted(c.index for c in batch.choices) == [0, 1]


# ------------------------------------------------------------------ 2. continuous batching through the API


def test_short_request_finishes_while_long_streams_run(base_url: str) -> None:
    async def run() -> tuple[list[float], float, float]:
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
            async def long_stream() -> float:
                # long enough to outlast the short request on a fast step (~10 ms at batch 3 with int8)
                body = {"model": MODEL, "prompt": "Write a long essay about the ocean.", "max_tokens": 800,
                        "temperature": 0, "ignore_eos": True, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    async for _ in response.aiter_lines():
                        pass
                return time.monotonic()

            longs = [asyncio.create_task(long_stream()) for _ in range(3)]
            await asyncio.sleep(1.5)  # the long streams are decoding now
            start = time.monotonic()
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            first_token = None
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and first_token is None:
                        first_token = time.monotonic()
            short_done = time.monotonic()
            ends = await asyncio.gather(*longs)
            assert first_token is not None
            return list(ends), first_token - start, short_done
    ends, ttft, short_done = asyncio.run(run())
    assert short_done < min(ends), (short_done, ends)
    assert ttft < 5.0


# ------------------------------------------------------------------ 3. disconnects abort and free everything


def _metric(text: str, name: str) -> float:
    value = metric_value(text, name)
    assert value is not None, f"{name} not exposed"
    return value


def test_fifty_streaming_clients_disconnect_and_resources_return(base_url: str) -> None:
    async def run() -> None:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as http:
            async def client(i: int) -> None:
                body = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 400, "temperature": 0.8,
                        "ignore_eos": True, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    seen = 0
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            seen += 1
                            if seen == 2:
                                return  # leaving the context closes the connection mid-stream

            await asyncio.gather(*(client(i) for i in range(50)))
    asyncio.run(run())
    deadline = time.monotonic() + 2.0
    while True:
        text = httpx.get(base_url + "/metrics").text
        running = _metric(text, "tokenmill:num_requests_running")
        usage = _metric(text, "tokenmill:kv_cache_usage_perc")
        waiting = _metric(text, "tokenmill:num_requests_waiting")
        if running == 0 and usage == 0 and waiting == 0:
            break
        assert time.monotonic() < deadline, (running, waiting, usage)
        time.sleep(0.05)
    ok = httpx.post(base_url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_non_streaming_disconnect_aborts(base_url: str) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + "/v1/completions", timeout=1.5,
                   json={"model": MODEL, "prompt": "Go on", "max_tokens": 2000, "ignore_eos": True})
    deadline = time.monotonic() + 2.0
    while _metric(httpx.get(base_url + "/metrics").text, "tokenmill:num_requests_running") != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)


# ------------------------------------------------------------------ 4. bad inputs

TOO_LONG = "word " * 9000
BAD_INPUTS = [
    ("/v1/completions", "{not json", 400),
    ("/v1/completions", [1, 2, 3], 400),
    ("/v1/completions", {"model": MODEL}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": 123}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 7}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": -7}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 99}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 9}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [""]}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": -3}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "suffix": "y"}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True, "max_tokens": -1}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "prompt_logprobs": 21}, 400),
    ("/tokenize", {"model": MODEL}, 400),
    ("/tokenize", {"model": MODEL, "prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400),
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404),
    ("/detokenize", {"model": MODEL, "tokens": [-1]}, 400),
    ("/detokenize", {"model": MODEL, "tokens": "abc"}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": [999999]}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": TOO_LONG}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10, "min_tokens": 20}, 400),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    ("/v1/chat/completions", {"model": MODEL}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": TOO_LONG}]}, 400),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404),
    ("/v1/nothing-here", {}, 404),
]


@pytest.mark.parametrize("path,body,status", BAD_INPUTS, ids=[f"{i}" for i in range(len(BAD_INPUTS))])
def test_bad_inputs_get_openai_errors(base_url: str, path: str, body: object, status: int) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(base_url + path, content=content, headers={"content-type": "application/json"},
                          timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["code"] == status


def test_server_keeps_serving_after_bad_inputs(client: openai.OpenAI, base_url: str) -> None:
    for path, body, _ in BAD_INPUTS[:10]:
        httpx.post(base_url + path, content=body if isinstance(body, str) else json.dumps(body), timeout=60)
    out = client.completions.create(model=MODEL, prompt="Still alive?", max_tokens=3, temperature=0)
    assert out.choices[0].text
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", temperature=-1)


# ------------------------------------------------------------------ 5. metrics


def test_metrics_move_as_requests_run(client: openai.OpenAI, base_url: str) -> None:
    before = httpx.get(base_url + "/metrics").text
    client.completions.create(model=MODEL, prompt="Metrics test", max_tokens=7, temperature=0,
                              extra_body={"ignore_eos": True})
    after = httpx.get(base_url + "/metrics").text
    names = ["tokenmill:time_to_first_token_seconds_count", "tokenmill:inter_token_latency_seconds_count",
             "tokenmill:e2e_request_latency_seconds_count", "tokenmill:request_queue_time_seconds_count",
             "tokenmill:generation_tokens_total", "tokenmill:prompt_tokens_total",
             "tokenmill:prefix_cache_queries_total"]
    for name in names:
        assert _metric(after, name) > (_metric(before, name) if name in before else 0), name
    generated = "tokenmill:generation_tokens_total"
    assert _metric(after, generated) - _metric(before, generated) == 7
    gauges = ["tokenmill:num_requests_running", "tokenmill:num_requests_waiting", "tokenmill:kv_cache_usage_perc",
              "tokenmill:prefix_cache_hits_total", "tokenmill:num_preemptions_total"]
    for name in gauges:
        _metric(after, name)
    assert 'tokenmill:request_success_total{finished_reason="length"' in after


# ------------------------------------------------------------------ admission control, API key, shutdown


def test_admission_control_api_key_and_graceful_shutdown() -> None:
    with live_server("--api-key", "secret", "--max-num-seqs", "1", "--max-waiting-requests", "2") as server:
        url = server.url
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/v1/models", headers={"x-api-key": "secret"}).status_code == 200  # Anthropic's header
        denied = httpx.post(url + "/v1/messages", json={}, headers={"x-api-key": "wrong"})
        assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
        headers = {"Authorization": "Bearer secret"}

        async def flood() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=120, headers=headers) as http:
                body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 12, "ignore_eos": True}
                return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(8)))
        responses = asyncio.run(flood())
        statuses = sorted(r.status_code for r in responses)
        assert 200 in statuses and 429 in statuses, statuses
        rejected = next(r for r in responses if r.status_code == 429)
        assert rejected.headers.get("retry-after") and rejected.json()["error"]["code"] == 429
        ok = httpx.post(url + "/v1/completions", headers=headers, json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                        timeout=60)
        assert ok.status_code == 200
        # SIGTERM: graceful shutdown, exit status 0
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=20) == 0
