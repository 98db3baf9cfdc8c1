"""Every tool-call parser on fixed model outputs of its family: valid, several calls, JSON strings holding
brackets, quotes and escapes, cut short, malformed. Streamed in pieces split at every point (and whole), the
deltas add up to exactly the whole parse; a malformed call is content and never breaks the stream."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenmill.tool_parsers import PARSERS, ToolCallStreamer, ToolParser, detect_parser

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer"}},
    "required": ["city"]}}
NOTE = {"name": "save_note", "parameters": {"type": "object", "properties": {
    "text": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["text"]}}
TOOLS = [WEATHER, NOTE]
TRICKY = 'a "quoted" {brace} [bracket] back\\slash </tool_call> ]'  # a string argument no format may break on

# (parser, output, expected content, expected calls as (name, arguments))
Case = tuple[str, str, str | None, list[tuple[str, dict[str, Any]]]]
CASES: list[Case] = [
    ("hermes", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
     '</tool_call>\n<tool_call>\n{"name": "save_note", "arguments": ' + json.dumps({"text": TRICKY, "tags": ["x"]})
     + '}\n</tool_call>', "Checking.",
     [("get_weather", {"city": "Paris", "days": 2}), ("save_note", {"text": TRICKY, "tags": ["x"]})]),
    ("hermes", "No tools needed: 2 < 3 and <tool> is not a tag.", "No tools needed: 2 < 3 and <tool> is not a tag.",
     []),
    ("hermes", '{"name": "get_weather", "arguments": {"city": "Oslo"}}', None, [("get_weather", {"city": "Oslo"})]),
    ("hermes", '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```', None,
     [("get_weather", {"city": "Oslo"})]),
    ("hermes", '{"name": "unknown_tool", "arguments": {}}', '{"name": "unknown_tool", "arguments": {}}', []),
    ("hermes", '{"city": "Oslo"}', '{"city": "Oslo"}', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}; '
     '{"name": "save_note", "parameters": ' + json.dumps({"text": TRICKY}) + "}", None,
     [("get_weather", {"city": "Rome", "unit": "celsius"}), ("save_note", {"text": TRICKY})]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', None,
     [("get_weather", {"city": "Rome"})]),
    ("llama3_json", "It is sunny in Rome.", "It is sunny in Rome.", []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lima"}}, '
     '{"name": "save_note", "arguments": ' + json.dumps({"text": TRICKY}) + "}]", "Sure.",
     [("get_weather", {"city": "Lima"}), ("save_note", {"text": TRICKY})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}[TOOL_CALLS]save_note[ARGS]' + json.dumps(
        {"text": TRICKY}), None, [("get_weather", {"city": "Lima"}), ("save_note", {"text": TRICKY})]),
    ("qwen3_coder", "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=save_note>\n"
     f"<parameter=text>\n{TRICKY}\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n</function>\n"
     "</tool_call>", "Let me look.",
     [("get_weather", {"city": "New York", "days": 3}), ("save_note", {"text": TRICKY, "tags": ["a", "b"]})]),
    ("pythonic", f"[get_weather(city='Kyiv', days=2), save_note(text={TRICKY!r}, tags=['x'])]", None,
     [("get_weather", {"city": "Kyiv", "days": 2}), ("save_note", {"text": TRICKY, "tags": ["x"]})]),
    ("pythonic", "<|python_start|>[get_weather(city=\"Kyiv\", unit=\"celsius\")]<|python_end|>", None,
     [("get_weather", {"city": "Kyiv", "unit": "celsius"})]),
    ("pythonic", "[1, 2, 3] are numbers.", "[1, 2, 3] are numbers.", []),
    ("deepseek_v3", "Calling.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
     '{"city": "Cairo"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>save_note\n```json\n'
     + json.dumps({"text": TRICKY}) + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Calling.",
     [("get_weather", {"city": "Cairo"}), ("save_note", {"text": TRICKY})]),
]


def parser(name: str, lenient: bool = True) -> ToolParser:
    return PARSERS[name](TOOLS, lenient=lenient)


def stream(name: str, pieces: list[str]) -> tuple[str, list[dict[str, Any]]]:
    streamer = ToolCallStreamer(parser(name))
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        delta, deltas = streamer.feed(piece, final=i == len(pieces) - 1)
        content += delta
        for call_delta in deltas:
            call = calls.setdefault(call_delta["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in call_delta:
                assert call["id"] is None, "a call announced twice"
                call.update(id=call_delta["id"], name=call_delta["function"]["name"])
            call["arguments"] += call_delta["function"]["arguments"]
    assert list(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize(("name", "text", "content", "expected"), CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_whole_outputs_parse_as_the_family_writes_them(name: str, text: str, content: str | None,
                                                       expected: list[tuple[str, dict[str, Any]]]) -> None:
    parsed_content, calls = parser(name).parse(text)
    assert parsed_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize(("name", "text", "content", "expected"), CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_every_chunking_streams_exactly_the_whole_parse(name: str, text: str, content: str | None,
                                                        expected: list[tuple[str, dict[str, Any]]]) -> None:
    whole_content, whole_calls = parser(name).parse(text)
    want = [(c.name, c.arguments) for c in whole_calls]
    chunkings = [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]
    chunkings += [[text[i:i + 7] for i in range(0, len(text), 7)]]
    for pieces in chunkings:
        streamed_content, calls = stream(name, pieces)
        assert streamed_content == (whole_content or ""), pieces
        assert [(c["name"], c["arguments"]) for c in calls] == want, pieces


def test_cut_short_and_malformed_calls() -> None:
    hermes = parser("hermes")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    # cut short (max_tokens) after a complete call: the complete one kept, the cut one dropped
    content, calls = hermes.parse(call + '\n<tool_call>\n{"name": "save_note", "arguments": {"te')
    assert content is None and [c.name for c in calls] == ["get_weather"]
    # alone, cut short or broken: the text is content, as vLLM returns it
    for text in ['<tool_call>\n{"name": "get_weather", "argu', "<tool_call>\n{broken}\n</tool_call>",
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>']:
        assert hermes.parse(text) == (text, [])
        stream("hermes", list(text))  # streamed, it never raises
    assert parser("pythonic").parse("[get_weather(city=open('x'))]") == ("[get_weather(city=open('x'))]", [])
    assert parser("mistral").parse("[TOOL_CALLS][{oops}]") == ("[TOOL_CALLS][{oops}]", [])
    # strict hermes: a bare JSON answer stays content
    bare = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    assert parser("hermes", lenient=False).parse(bare) == (bare, [])
    # a partial tag is held back while streaming, released when it turns out to be text
    streamer = ToolCallStreamer(parser("hermes"))
    assert streamer.feed("a <tool_") == ("a", [])
    assert streamer.feed("maybe", final=True) == (" <tool_maybe", [])


def test_the_chat_template_picks_the_parser() -> None:
    assert detect_parser("{{ '<tool_call>' }}")[0] == "hermes"
    assert detect_parser("<tool_call>\n<function=name>")[0] == "qwen3_coder"
    assert detect_parser("[AVAILABLE_TOOLS] [TOOL_CALLS]")[0] == "mistral"
    assert detect_parser("<|python_tag|>")[0] == "llama3_json"
    assert detect_parser("<｜tool▁calls▁begin｜>")[0] == "deepseek_v3"
    assert detect_parser("[func_name1(params_name1=params_value1)]")[0] == "pythonic"
    assert detect_parser(None) == ("hermes", "the chat template shows no call format of its own")


@pytest.mark.parametrize(("name", "complete", "cut"), [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     '\n<tool_call>\n{"na'),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
     "</tool_call>", "\n<tool_call>\n<func"),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}', ', {"name": "sav'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', '; {"name": "save_note", "par'),
])
def test_a_call_cut_short_by_max_tokens_after_complete_ones_is_dropped(name: str, complete: str, cut: str) -> None:
    content, calls = parser(name).parse(complete + cut)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather",
                                                                                          {"city": "Paris"})]
    streamed_content, streamed = stream(name, list(complete + cut))
    assert streamed_content == "" and streamed[0]["name"] == "get_weather"
