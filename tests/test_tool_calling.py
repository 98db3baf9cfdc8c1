"""Tool calling and structured outputs through the OpenAI API (the official `openai` client against a live
server): forced calls always parse and match their function's schema, streamed or not; the Hermes parser and its
streaming form agree; tool results reach the prompt."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tokenmill.bench.server_process import live_server
from tokenmill.model.tokenizer import Tokenizer
from tokenmill.server.tools import prepare_conversation
from tokenmill.tool_parsers.hermes import HermesParser

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
                   "required": ["timezone"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it in Tokyo?"}]


@pytest.fixture(scope="module")
def client() -> openai.OpenAI:
    with live_server("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-model-len", "2048") as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def check_calls(calls: list, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def collect_stream(stream) -> tuple[str, dict[int, dict], str | None]:  # noqa: ANN001
    content, calls, finish = "", {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.id:
                assert call["id"] is None
                call["id"], call["name"] = delta.id, delta.function.name
            call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


# ------------------------------------------------------------------ over HTTP


def test_named_tool_choice_streamed_and_not(client: openai.OpenAI) -> None:
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=ASK, tools=[WEATHER, TIME], max_tokens=80, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    check_calls(choice.message.tool_calls, {"get_weather"})
    assert len(choice.message.tool_calls) == 1 and choice.finish_reason == "stop" and not choice.message.content
    content, calls, finish = collect_stream(client.chat.completions.create(stream=True, **kwargs))
    assert not content and finish == "stop" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == json.loads(choice.message.tool_calls[0].function.arguments)


def test_required_tool_choice_sampled_calls_always_parse(client: openai.OpenAI) -> None:
    for seed in range(4):
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
            parallel_tool_calls=False, max_tokens=150, temperature=1.0, seed=seed)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
        assert len(choice.message.tool_calls) == 1
    # parallel calls: this small model keeps calling until max_tokens; the complete calls still come back
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        max_tokens=150, temperature=0)
    check_calls(reply.choices[0].message.tool_calls, {"get_weather", "get_time"})
    content, calls, finish = collect_stream(client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, max_tokens=150, temperature=0, stream=True))
    assert finish == "tool_calls" and list(calls) == [0] and not content
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])


def test_auto_and_none_and_tool_results(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, tools=[WEATHER, TIME],
                                           max_tokens=60, temperature=0)
    choice = reply.choices[0]
    if choice.message.tool_calls:  # the model decides; whatever it wrote, calls come out parsed
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
    else:
        assert choice.message.content
    follow_up = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=follow_up,
                                           tools=[WEATHER, TIME], tool_choice="none", max_tokens=30, temperature=0)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls


def test_response_format_and_vllm_fields(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {
        "capital": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 2000}},
        "required": ["capital", "population_millions"]}
    messages = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=60, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert "".join(c.choices[0].delta.content or "" for c in stream) == reply.choices[0].message.content
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=200,
                                           temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=10,
                                           extra_body={"guided_choice": ["Paris", "Lyon"]})
    assert reply.choices[0].message.content in ("Paris", "Lyon")
    completion = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Call me at", max_tokens=12,
                                           extra_body={"structured_outputs": {"regex": r" [0-9]{3}-[0-9]{4}"}})
    assert completion.choices[0].text[:1] == " " and completion.choices[0].text[4] == "-"


@pytest.mark.parametrize(("body", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "strin"),
    ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "unclosed group"),
    ({"extra_body": {"guided_regex": "a+", "guided_choice": ["a"]}}, "only one"),
    ({"extra_body": {"structured_outputs": {"regexp": "a+"}}}, "regexp"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
])
def test_bad_constraints_are_400s(client: openai.OpenAI, body: dict, message: str) -> None:
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=5, **body)


def test_auto_tool_choice_needs_the_flags(base_url: str) -> None:  # the shared server runs without them
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, tools=[WEATHER], max_tokens=5)


# ------------------------------------------------------------------ the parser and the prompt


def test_tools_and_tool_results_reach_a_template_that_knows_no_tools(tokenizer: Tokenizer) -> None:
    messages = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 degrees"}]
    tools = [WEATHER["function"], TIME["function"]]
    rendered, extra = prepare_conversation(messages, tools, tokenizer.chat_template, HermesParser(tools))
    text = tokenizer.apply_chat_template(rendered, **extra)
    assert "<tools>" in text and '"get_time"' in text
    assert HermesParser().format_call("get_weather", '{"city": "Paris", "unit": "celsius"}') in text
    assert "<|im_start|>tool\n18 degrees<|im_end|>" in text
    # a template that reads `tools` gets them itself, untouched
    _, extra = prepare_conversation(messages, tools, "{{ tools }}{% for m in messages %}{% endfor %}", HermesParser())
    assert extra == {"tools": [{"type": "function", "function": t} for t in tools]}
