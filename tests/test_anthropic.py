"""The Anthropic Messages API (/v1/messages), live on loopback, driven by the official `anthropic` client: text,
streamed and not, forced tool calls, stop sequences, JSON output, counted tokens, and errors in Anthropic's shape."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.server_utils import assert_idle_soon
from tokenmill.server.metrics import metric_value

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0}  # the SDK no longer has a temperature argument; the API still takes the field
ASK = [{"role": "user", "content": "Write a short poem about the sea."}]
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def client(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def test_text_message_equals_the_chat_completion_and_counts_its_tokens(client: anthropic.Anthropic,
                                                                       base_url: str) -> None:
    message = client.messages.create(model=MODEL, max_tokens=24, messages=ASK, system="You are a poet.",
                                     extra_body=GREEDY)
    chat = httpx.post(base_url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "system", "content": "You are a poet."}, *ASK]}).json()
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    [block] = message.content
    assert block.type == "text" and block.text == chat["choices"][0]["message"]["content"]
    assert message.stop_reason == ("max_tokens" if chat["choices"][0]["finish_reason"] == "length" else "end_turn")
    assert message.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert message.usage.output_tokens == chat["usage"]["completion_tokens"]
    counted = client.messages.count_tokens(model=MODEL, messages=ASK, system="You are a poet.")
    assert counted.input_tokens == message.usage.input_tokens


def test_stream_equals_the_whole_message(client: anthropic.Anthropic, base_url: str) -> None:
    whole = client.messages.create(model=MODEL, max_tokens=20, messages=ASK, extra_body=GREEDY)
    with client.messages.stream(model=MODEL, max_tokens=20, messages=ASK, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    kinds = []
    with httpx.stream("POST", base_url + "/v1/messages", timeout=60, json={
            "model": MODEL, "max_tokens": 5, "messages": ASK, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("event: "):
                kinds.append(line.removeprefix("event: "))
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}


def test_forced_tool_use_streamed_and_not(client: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = {"type": "tool", "name": "get_weather"}
    message = client.messages.create(model=MODEL, max_tokens=60, messages=ask, tools=[WEATHER], tool_choice=choice,
                                     extra_body=GREEDY)
    [call] = [b for b in message.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_") and message.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    with client.messages.stream(model=MODEL, max_tokens=60, messages=ask, tools=[WEATHER], tool_choice=choice,
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    [streamed] = [b for b in final.content if b.type == "tool_use"]
    assert streamed.input == call.input and final.stop_reason == "tool_use"
    # the result goes back as a tool_result block; the model answers in text
    follow = client.messages.create(model=MODEL, max_tokens=10, tools=[WEATHER], tool_choice={"type": "none"},
                                    extra_body=GREEDY, messages=[
        *ask, {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name,
                                                 "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24 C"}]}])
    assert follow.content[0].type == "text" and follow.content[0].text


def test_stop_sequences_and_json_output(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY).content[0].text
    words = whole.split()
    stop = words[len(words) // 2]
    cut = client.messages.create(model=MODEL, max_tokens=24, messages=ASK, stop_sequences=[stop], extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == whole[:whole.index(stop)]
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"]}
    answer = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY,
                                    messages=[{"role": "user", "content": "The capital of France, as JSON"}],
                                    output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(answer.content[0].text), schema)


@pytest.mark.parametrize("body,status", [
    ({"model": MODEL, "messages": ASK}, 400),  # max_tokens is required
    ({"model": MODEL, "max_tokens": 0, "messages": ASK}, 400),
    ({"model": MODEL, "max_tokens": 5, "messages": []}, 400),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400),
    ({"model": MODEL, "max_tokens": 5, "messages": ASK, "tool_choice": {"type": "any"}}, 400),
    ({"model": MODEL, "max_tokens": 5, "messages": ASK, "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "nope"}}, 400),
    ({"model": MODEL, "max_tokens": 5, "messages": ASK, "tools": [WEATHER]}, 400),  # auto needs a parser
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]}, 400),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]}, 400),
    ({"model": MODEL, "max_tokens": 5, "messages": ASK, "temperature": 3}, 400),
    ({"model": "claude-nope", "max_tokens": 5, "messages": ASK}, 404),
])
def test_bad_requests_get_anthropic_errors(base_url: str, body: dict, status: int) -> None:
    response = httpx.post(base_url + "/v1/messages", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["message"]
    assert error["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_official_client_raises_on_errors(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=5, messages=[])
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=5, messages=ASK)


def test_metrics_count_the_endpoint(client, base_url: str) -> None:  # noqa: ANN001
    def served() -> float:
        text = httpx.get(base_url + "/metrics").text
        return metric_value(text, 'tokenmill:endpoint_requests_total{endpoint="/v1/messages",model_name="{MODEL}"}'
                            .replace("{MODEL}", MODEL)) or 0.0

    before = served()
    client.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    assert served() == before + 1


def test_aborted_streams_leak_nothing(base_url: str) -> None:
    async def run() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            async def one() -> None:
                body = {"model": MODEL, "max_tokens": 200, "messages": ASK, "stream": True}
                async with http.stream("POST", "/v1/messages", json=body) as response:
                    async for line in response.aiter_lines():
                        if line == "event: content_block_delta":
                            return  # leaving closes the connection mid-stream
            await asyncio.gather(*(one() for _ in range(8)))
    asyncio.run(run())
    assert_idle_soon(base_url)
