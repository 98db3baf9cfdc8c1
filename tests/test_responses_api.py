"""OpenAI's Responses API (/v1/responses), live on loopback, driven by the official client's `responses.create`
and `responses.stream`: text, JSON schemas, function calls, continued conversations, the store's limits, and
errors."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from tests.server_utils import assert_idle_soon
from tokenmill.server.errors import APIError
from tokenmill.server.metrics import metric_value
from tokenmill.server.responses_api import ResponseStore

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def count_tokens(base_url: str, messages: list[dict]) -> int:
    return httpx.post(base_url + "/tokenize", json={"messages": messages}).json()["count"]


def test_text_response_equals_the_chat_completion(client: openai.OpenAI, base_url: str) -> None:
    response = client.responses.create(model=MODEL, input="Name three colors.", instructions="Be brief.",
                                       max_output_tokens=16, temperature=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colors."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage.input_tokens == chat.usage.prompt_tokens == count_tokens(base_url, messages)
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert client.responses.retrieve(response.id).output_text == response.output_text


def test_stream_events_build_the_same_response(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=MODEL, input="Say hello to the world.", max_output_tokens=12,
                                    temperature=0)
    with client.responses.stream(model=MODEL, input="Say hello to the world.", max_output_tokens=12,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens


def test_json_schema_text_format(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}
    response = client.responses.create(model=MODEL, input="The capital of France, as JSON.", temperature=0,
                                       max_output_tokens=40,
                                       text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    jsonschema.validate(json.loads(response.output_text), schema)


def test_function_call_and_its_output_continue_the_conversation(client: openai.OpenAI, base_url: str) -> None:
    ask = "What is the weather in Paris?"
    choice = {"type": "function", "name": "get_weather"}
    response = client.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice=choice, temperature=0)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    with client.responses.stream(model=MODEL, input=ask, tools=[WEATHER], tool_choice=choice,
                                 temperature=0) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert streamed.output[0].arguments == call.arguments
    follow = client.responses.create(model=MODEL, previous_response_id=response.id, temperature=0,
                                     max_output_tokens=8, input=[{"type": "function_call_output",
                                                                  "call_id": call.call_id, "output": "Sunny"}])
    assert follow.previous_response_id == response.id and follow.output_text
    called = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    history = [{"role": "user", "content": ask}, {"role": "assistant", "content": "", "tool_calls": [called]},
               {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"}]
    assert follow.usage.input_tokens == count_tokens(base_url, history)


def test_previous_response_id_carries_the_conversation(client: openai.OpenAI, base_url: str) -> None:
    first = client.responses.create(model=MODEL, input="My name is Ada.", instructions="Be brief.",
                                    max_output_tokens=10, temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=10, temperature=0)
    # instructions are not carried over; the earlier turn and its answer are
    history = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "What is my name?"}]
    assert second.usage.input_tokens == count_tokens(base_url, history)
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="again", previous_response_id=unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")


def test_the_store_evicts_the_least_recently_used() -> None:
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put({"id": name}, [])
    store.get("a")  # now b is the least recently used
    store.put({"id": "c"}, [])
    assert len(store) == 2 and store.get("a") and store.get("c")
    with pytest.raises(APIError) as error:
        store.get("b")
    assert error.value.status == 404


@pytest.mark.parametrize("body", [
    {"model": MODEL},
    {"model": MODEL, "input": []},
    {"model": MODEL, "input": "x", "max_output_tokens": 0},
    {"model": MODEL, "input": "x", "tool_choice": "required"},
    {"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]},
    {"model": MODEL, "input": "x", "tools": [WEATHER]},  # "auto" needs a tool-call parser
    {"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}},
    {"model": MODEL, "input": [{"role": "wizard", "content": "x"}]},
    {"model": MODEL, "input": "x", "temperature": 5},
])
def test_bad_requests_get_openai_errors(base_url: str, body: dict) -> None:
    response = httpx.post(base_url + "/v1/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"]


def test_metrics_count_the_endpoint(client, base_url: str) -> None:  # noqa: ANN001
    def served() -> float:
        text = httpx.get(base_url + "/metrics").text
        return metric_value(text, 'tokenmill:endpoint_requests_total{endpoint="/v1/responses",model_name="{MODEL}"}'
                            .replace("{MODEL}", MODEL)) or 0.0

    before = served()
    client.responses.create(model=MODEL, input='Hi', max_output_tokens=2)
    assert served() == before + 1


def test_aborted_streams_leak_nothing(base_url: str) -> None:
    async def run() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            async def one() -> None:
                body = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 200, "stream": True}
                async with http.stream("POST", "/v1/responses", json=body) as response:
                    async for line in response.aiter_lines():
                        if line == "event: response.output_text.delta":
                            return
            await asyncio.gather(*(one() for _ in range(8)))
    asyncio.run(run())
    assert_idle_soon(base_url)
