"""Tool calls in each family's own format, end to end: tiny random Llama-architecture GGUFs written here, each
with a byte-level vocabulary, its family's marker tokens as special tokens and a chat template in its family's
shape (Llama 3.x JSON calls, Mistral's [TOOL_CALLS], ...). A random model writes nothing sensible, so whatever it
emits under a forced-call grammar tests the grammar: every forced call must parse, in the family's format, into
arguments valid against the function's schema, and the grammar must agree with the token masks on what each
marker token spells."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import openai
import pytest

from tests.test_tool_calling import collect_stream
from tokenmill import LLM, SamplingParams
from tokenmill.bench.server_process import live_server
from tokenmill.model.tokenizer import Tokenizer
from tokenmill.server.tools import forced_call_constraint, marker_tokens, prepare_conversation, resolve_parser
from tokenmill.tool_parsers import PARSERS, detect_parser

WEATHER = {"name": "get_weather", "description": "Current weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}
NOTE = {"name": "save_note", "description": "Save a note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "maxLength": 12}}, "required": ["text"]}}
SCHEMAS = {t["name"]: t["parameters"] for t in (WEATHER, NOTE)}

LLAMA3_TEMPLATE = """{{- '<|begin_of_text|>' -}}
{%- for message in messages -%}
{%- if message.role == 'user' and loop.first and tools -%}
<|start_header_id|>user<|end_header_id|>

Given the following functions, respond with a JSON for a function call with its proper arguments.
Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.

{% for tool in tools %}{{ tool | tojson }}
{% endfor %}{{ message.content }}<|eot_id|>
{%- elif message.role == 'assistant' and message.tool_calls -%}
<|start_header_id|>assistant<|end_header_id|>

{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", "parameters": \
{{- call.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif message.role == 'tool' -%}
<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else -%}
<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start_header_id|>assistant<|end_header_id|>

{% endif -%}"""

MISTRAL_TEMPLATE = """{{- bos_token -}}
{%- if tools -%}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}[INST]{{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls -%}[TOOL_CALLS][
{%- for call in message.tool_calls -%}{"name": "{{ call.function.name }}", "arguments": \
{{- call.function.arguments | tojson }}}
{%- if not loop.last %}, {% endif -%}{%- endfor -%}]{{ eos_token }}
{%- elif message.role == 'tool' -%}[TOOL_RESULTS]{"content": {{ message.content | tojson }}}[/TOOL_RESULTS]
{%- else -%}{{ message.content }}{{ eos_token }}
{%- endif -%}
{%- endfor -%}"""

CHATML_TOOLS = """{%- for message in messages -%}
{%- if loop.first and tools -%}<|im_start|>system
You may call functions. Signatures:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
FORMAT<|im_end|>
{% endif -%}
{%- if message.role == 'assistant' and message.tool_calls -%}<|im_start|>assistant
{% for call in message.tool_calls %}CALL{% endfor %}<|im_end|>
{% elif message.role == 'tool' -%}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else -%}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant
{% endif -%}"""
HERMES_TEMPLATE = CHATML_TOOLS.replace("FORMAT", 'Reply with <tool_call>\n{"name": <name>, "arguments": <args>}\n'
                                                 "</tool_call>").replace(
    "CALL", '<tool_call>\n{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n'
            "</tool_call>")
QWEN3_CODER_TEMPLATE = CHATML_TOOLS.replace("FORMAT", "Reply with <tool_call>\n<function=NAME>\n<parameter=KEY>\n"
                                                      "VALUE\n</parameter>\n</function>\n</tool_call>").replace(
    "CALL", "<tool_call>\n<function={{ call.function.name }}>\n{% for key, value in "
            "call.function.arguments.items() %}<parameter={{ key }}>\n{{ value }}\n</parameter>\n"
            "{% endfor %}</function>\n</tool_call>")
PYTHONIC_TEMPLATE = CHATML_TOOLS.replace("FORMAT", "Reply with [func_name1(params_name1=params_value1)]").replace(
    "CALL", "[{{ call.function.name }}({% for key, value in call.function.arguments.items() %}"
            "{{ key }}={{ value | tojson }}{% if not loop.last %}, {% endif %}{% endfor %})]")
DEEPSEEK_TEMPLATE = """{{- bos_token -}}
{%- if tools -%}Tools: {{ tools | tojson }}{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}<｜User｜>{{ message.content }}
{%- elif message.role == 'assistant' and message.tool_calls -%}<｜Assistant｜><｜tool▁calls▁begin｜>
{%- for call in message.tool_calls -%}<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ call.function.name }}
```json
{{ call.function.arguments | tojson }}
```<｜tool▁call▁end｜>{%- endfor -%}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>
{%- elif message.role == 'tool' -%}<｜tool▁outputs▁begin｜>{{ message.content }}<｜tool▁outputs▁end｜>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<｜Assistant｜>{%- endif -%}"""
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# family -> (control tokens, user-defined tokens, end-of-turn token, chat template): each as its models' GGUFs
# keep them (Qwen's <tool_call> is a user-defined token, not a control one)
FAMILIES: dict[str, tuple[list[str], list[str], str, str]] = {
    "hermes": (CHATML, ["<tool_call>", "</tool_call>"], "<|im_end|>", HERMES_TEMPLATE),
    "qwen3_coder": (CHATML, ["<tool_call>", "</tool_call>"], "<|im_end|>", QWEN3_CODER_TEMPLATE),
    "llama3_json": (["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
                     "<|python_tag|>"], [], "<|eot_id|>", LLAMA3_TEMPLATE),
    "mistral": (["<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                 "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[ARGS]"], [], "</s>", MISTRAL_TEMPLATE),
    "pythonic": (CHATML, [], "<|im_end|>", PYTHONIC_TEMPLATE),
    "deepseek_v3": (["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                     "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                     "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"], [],
                    "<｜end▁of▁sentence｜>", DEEPSEEK_TEMPLATE),
}


def _byte_pieces() -> list[str]:
    """GPT-2's byte-to-character table: the 256 single-byte pieces of a byte-level BPE vocabulary."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_tiny_gguf(path: Path, control: list[str], user_defined: list[str], eos: str, template: str,
                    seed: int = 0) -> None:
    """A 2-layer random Llama GGUF: the 256 byte pieces, then the control and user-defined tokens (llama.cpp's
    token types 3 and 4)."""
    import gguf

    tokens = _byte_pieces() + control + user_defined
    vocab, hidden, ffn, heads, kv_heads, layers = len(tokens), 64, 128, 4, 2, 2
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3] * len(control) + [4] * len(user_defined))
    writer.add_token_merges([])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(tokens.index(eos))
    writer.add_chat_template(template)
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    head_dim = hidden // heads
    writer.add_tensor("token_embd.weight", weight(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("output.weight", weight(vocab, hidden))
    for i in range(layers):
        for name, shape in {"attn_q": (hidden, hidden), "attn_k": (kv_heads * head_dim, hidden),
                            "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, hidden),
                            "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", weight(*shape))
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, Path]:  # noqa: ANN001
    path = tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}.gguf"
    write_tiny_gguf(path, *FAMILIES[request.param])
    return request.param, path


def test_the_template_renders_tools_and_calls_that_parse_back(family: tuple[str, Path]) -> None:
    name, path = family
    tokenizer = Tokenizer.from_path(str(path))
    assert detect_parser(tokenizer.chat_template)[0] == name
    parser_class = resolve_parser("auto", tokenizer.chat_template)
    assert parser_class is PARSERS[name]
    arguments = '{"city": "Lima", "unit": "celsius"}'
    messages = [{"role": "user", "content": "Weather in Lima?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "18 degrees"}]
    rendered, extra = prepare_conversation(messages, [WEATHER, NOTE], tokenizer.chat_template,
                                           parser_class([WEATHER, NOTE]))
    text = tokenizer.apply_chat_template(rendered, add_generation_prompt=False, **extra)
    assert '"save_note"' in text and "18 degrees" in text
    # the assistant's turn as the template wrote it (after the generation prompt, up to its end-of-turn token)
    # parses back into the same call
    prompt, _ = prepare_conversation(messages[:1], [WEATHER, NOTE], tokenizer.chat_template,
                                     parser_class([WEATHER, NOTE]))
    start = len(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, **extra))
    turn = text[start:text.index(FAMILIES[name][2], start)]
    content, calls = parser_class([WEATHER, NOTE]).parse(turn)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", json.loads(arguments))]


def test_forced_calls_in_the_family_format_through_the_marker_tokens(family: tuple[str, Path]) -> None:
    """Offline: each parser's forced-call grammar on this tokenizer; the markers that are special tokens are
    emitted as those tokens (the text keeps them) and every sampled call parses against its schema."""
    name, path = family
    llm = LLM(str(path), max_model_len=1024, kv_cache_memory_gb=0.05)
    parser_class = PARSERS[name]
    spell, keep_special = marker_tokens(llm.tokenizer, parser_class)
    # control tokens among the markers: outputs keep special tokens (user-defined ones are text anyway)
    assert keep_special == any(m in FAMILIES[name][0] for m in parser_class.markers)
    prompt = [{"role": "user", "content": "Weather in Lima, and a note?"}]
    for parallel in (False, True):
        constraint = forced_call_constraint(parser_class(), [WEATHER, NOTE], None, parallel, spell)
        assert constraint.grammar is not None
        marker_ids = {int(token) for token in re.findall(r"<\[(\d+)\]>", constraint.grammar)}
        params = [SamplingParams(max_tokens=300, temperature=1.0, seed=seed, skip_special_tokens=False,
                                 structured_outputs=constraint) for seed in range(4)]
        for output in llm.chat([prompt] * 4, params, tools=[{"type": "function", "function": WEATHER},
                                                            {"type": "function", "function": NOTE}]):
            completion = output.outputs[0]
            # several calls may go on until max_tokens (the one cut short is dropped); one call ends itself
            assert completion.finish_reason == "stop" or parallel, (completion.text, completion.token_ids)
            assert marker_ids <= set(completion.token_ids)  # the grammar's marker tokens came as those tokens
            content, calls = parser_class([WEATHER, NOTE]).parse(completion.text)
            assert calls and content is None, completion.text
            assert parallel or len(calls) == 1
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_the_openai_client_gets_the_family_calls_plain_and_streamed(family: tuple[str, Path]) -> None:
    name, path = family
    # `python -m tokenmill serve`, as a user without the script on PATH starts it
    with live_server(str(path), "--enable-auto-tool-choice", "--tool-call-parser", "auto", "--max-model-len",
                     "1024", module="tokenmill") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        tools = [{"type": "function", "function": WEATHER}, {"type": "function", "function": NOTE}]
        for choice in ("required", {"type": "function", "function": {"name": "save_note"}}):
            kwargs: dict[str, Any] = dict(model=model, messages=[{"role": "user", "content": "Note: buy milk"}],
                                          tools=tools, tool_choice=choice, max_tokens=300, temperature=0,
                                          parallel_tool_calls=False)
            message = client.chat.completions.create(**kwargs).choices[0].message
            assert message.tool_calls and len(message.tool_calls) == 1, message
            call = message.tool_calls[0]
            assert choice == "required" or call.function.name == "save_note"
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            content, calls, finish = collect_stream(client.chat.completions.create(stream=True, **kwargs))
            assert not content and list(calls) == [0]
            assert (calls[0]["name"], calls[0]["arguments"]) == (call.function.name, call.function.arguments)
            assert finish == ("tool_calls" if choice == "required" else "stop")


def test_a_grammar_that_spells_an_added_token_text_holds(tmp_path: Path) -> None:
    """A user grammar that writes `<tool_call>` as text, on a vocabulary where it is an added (not special) token,
    as in every Qwen model: the grammar engine reads the token as the text it spells, so mask and matcher agree
    (before, the mask let the token through and the matcher rejected it: the request broke its grammar). Even with
    the token pushed by logit_bias the output is the grammar's."""
    path = tmp_path / "tiny-hermes.gguf"
    write_tiny_gguf(path, *FAMILIES["hermes"])
    token = Tokenizer.from_path(str(path)).backend.token_to_id("<tool_call>")
    extra = {"structured_outputs": {"regex": "<tool_call>[a-z]{3}"}, "logit_bias": {str(token): 100}}
    with live_server(str(path), "--max-model-len", "1024") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=20, temperature=0, extra_body=extra)
    assert re.fullmatch("<tool_call>[a-z]{3}", reply.choices[0].message.content or ""), reply
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("name", ["hermes", "mistral"])
def test_hugging_face_tokenizers_name_their_marker_tokens_too(name: str, tmp_path: Path) -> None:
    """A Hugging Face tokenizer.json as Qwen's and Mistral's are written: the markers are added tokens outside the
    model's vocabulary (Qwen's `<tool_call>` not special, Mistral's `[TOOL_CALLS]` special). The forced-call
    grammar names them by id, the first mask allows exactly the marker token, and the family's call, tokenized
    as the model writes it, walks the grammar to its end."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from tokenmill.structured_output.backend import Grammar, GrammarCompiler, grammar_definition
    from tokenmill.structured_output.bitmask import allocate_bitmask

    control, user_defined, eos, _ = FAMILIES[name]
    backend = HFTokenizer(models.BPE(vocab={p: i for i, p in enumerate(_byte_pieces())}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    tokenizer = Tokenizer.from_hf_dir(str(tmp_path))
    parser = PARSERS[name]()
    spell, _ = marker_tokens(tokenizer, PARSERS[name])
    grammar_text = forced_call_constraint(parser, [WEATHER], "get_weather", False, spell).grammar
    assert grammar_text is not None
    compiler = GrammarCompiler(tokenizer.backend.to_str(), tokenizer.vocab_size, [backend.token_to_id(eos)])
    grammar = Grammar(compiler.compile(grammar_definition("grammar", grammar_text)))
    marker = backend.token_to_id(parser.markers[0])
    bitmask = allocate_bitmask(1, tokenizer.vocab_size)
    grammar.fill_bitmask(bitmask, 0)
    allowed = [t for t in range(tokenizer.vocab_size) if int(bitmask[0, t // 32]) >> (t % 32) & 1]
    assert allowed == [marker]
    call = parser.format_call("get_weather", '{"city": "Lima", "unit": "celsius"}')
    tokens = tokenizer.encode(call, add_special_tokens=False)
    assert tokens[0] == marker
    assert all(grammar.accept(t) for t in tokens), grammar.error
    assert grammar.is_terminated or grammar.accept(backend.token_to_id(eos))
