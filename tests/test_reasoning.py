"""The reasoning parsers: whole outputs split as vLLM's deepseek_r1 and qwen3 parsers split them, and the
streaming split equal to the whole one at every chunk boundary."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import openai
import pytest

from tests.server_utils import live_server
from tokenmill.reasoning import REASONING_PARSERS, ReasoningStreamer, reasoning_parser

MODEL = "SmolLM2-135M-Instruct"

OUTPUTS = [
    "<think>\nLet me add 2 and 2.\n</think>\n\nThe answer is 4.",
    "Let me add 2 and 2.\n</think>\n\nThe answer is 4.",  # the template opened the block
    "The answer is 4.",
    "<think>still thinking when max_tokens hit",
    "  <think>a < b and </thi are not tags</think>x</think>y",
    "",
    "<th",
    "</think>",
]

EXPECTED = {
    "deepseek_r1": [
        ("\nLet me add 2 and 2.\n", "\n\nThe answer is 4."),
        ("Let me add 2 and 2.\n", "\n\nThe answer is 4."),
        ("The answer is 4.", ""),
        ("still thinking when max_tokens hit", ""),
        ("a < b and </thi are not tags", "x</think>y"),
        ("", ""),
        ("<th", ""),
        ("", ""),
    ],
    "qwen3": [
        ("\nLet me add 2 and 2.\n", "\n\nThe answer is 4."),
        (None, "Let me add 2 and 2.\n</think>\n\nThe answer is 4."),
        (None, "The answer is 4."),
        ("still thinking when max_tokens hit", ""),
        ("a < b and </thi are not tags", "x</think>y"),
        (None, ""),
        (None, "<th"),
        (None, "</think>"),
    ],
}


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_whole_outputs_split_like_vllm(name: str) -> None:
    parser = REASONING_PARSERS[name]
    assert [parser.split(text) for text in OUTPUTS] == EXPECTED[name]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("text", OUTPUTS)
def test_streaming_split_equals_the_whole_split_at_every_boundary(name: str, text: str) -> None:
    parser = REASONING_PARSERS[name]
    expected_reasoning, expected_answer = parser.split(text)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            streamer = ReasoningStreamer(parser)
            reasoning = answer = ""
            for chunk, final in ((text[:i], False), (text[i:j], False), (text[j:], True)):
                r, a = streamer.feed(chunk, final)
                # what has gone out is always a prefix of the final split: nothing is taken back
                reasoning, answer = reasoning + r, answer + a
                assert (expected_reasoning or "").startswith(reasoning) and expected_answer.startswith(answer)
            assert (reasoning, answer) == (expected_reasoning or "", expected_answer), (i, j)


def test_unknown_parser_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="deepseek_r1"):
        reasoning_parser("nope")


# ------------------------------------------------------------------ live: --reasoning-parser deepseek_r1

SHOT = "<think>two plus two is four</think>The answer is 4.\n"
JSON_SHOT = '<think>the key is a</think>{"a": 1}\n'


@pytest.fixture(scope="module")
def reasoning_server():  # noqa: ANN201
    """The bundled model with a template that opens a <think> block; few-shot prompts make it reason first."""
    template = str(Path(__file__).parent / "data" / "open_reasoning.jinja")
    with live_server("--quantization", "none", "--reasoning-parser", "deepseek_r1", "--chat-template",
                     template) as server:
        yield server.url


def test_chat_splits_reasoning_content_streamed_and_not(reasoning_server: str) -> None:
    client = openai.OpenAI(base_url=reasoning_server + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": SHOT * 4}]
    message = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                             temperature=0).choices[0].message
    assert message.reasoning_content == "two plus two is four"  # type: ignore[attr-defined]
    assert message.content is not None and message.content.startswith("The answer is 4.")
    reasoning = content = ""
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                stream=True):
        if chunk.choices:
            reasoning += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
            content += chunk.choices[0].delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)  # type: ignore[attr-defined]


def test_structured_output_applies_to_the_answer_after_the_reasoning(reasoning_server: str) -> None:
    client = openai.OpenAI(base_url=reasoning_server + "/v1", api_key="unused", max_retries=0, timeout=120)
    message = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": JSON_SHOT * 4}],
                                             max_tokens=30, temperature=0,
                                             response_format={"type": "json_object"}).choices[0].message
    assert message.reasoning_content == "the key is a"  # type: ignore[attr-defined]
    assert isinstance(json.loads(message.content or ""), dict)


def test_responses_and_messages_carry_the_reasoning(reasoning_server: str) -> None:
    client = openai.OpenAI(base_url=reasoning_server + "/v1", api_key="unused", max_retries=0, timeout=120)
    response = client.responses.create(model=MODEL, input=SHOT * 4, max_output_tokens=24, temperature=0)
    thought, answer = response.output[0], response.output[1]
    assert thought.type == "reasoning" and thought.content[0].text == "two plus two is four"  # type: ignore[union-attr]
    assert answer.type == "message" and response.output_text.startswith("The answer is 4.")
    with client.responses.stream(model=MODEL, input=SHOT * 4, max_output_tokens=24, temperature=0) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta")
        final = stream.get_final_response()
    assert deltas == "two plus two is four" and final.output_text == response.output_text
    claude = anthropic.Anthropic(base_url=reasoning_server, api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": SHOT * 4}]
    message = claude.messages.create(model=MODEL, max_tokens=24, messages=messages, extra_body={"temperature": 0})
    assert message.content[0].type == "thinking" and message.content[0].thinking == "two plus two is four"
    assert message.content[1].type == "text" and message.content[1].text.startswith("The answer is 4.")
    with claude.messages.stream(model=MODEL, max_tokens=24, messages=messages,
                                extra_body={"temperature": 0}) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in message.content]
