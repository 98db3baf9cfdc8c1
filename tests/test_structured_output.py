"""Structured outputs: every constrained output parses and validates (JSON schema via `jsonschema`, regex,
choice, Lark and GBNF grammars), greedy and sampled, alone and batched; unconstrained neighbours keep exactly
their tokens; grammars compile once per constraint, off the step loop; speculation composes."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from tests.engine_utils import run_engine as run
from tokenmill import kernels
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine, engine_core_from_config
from tokenmill.model.tokenizer import Tokenizer
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_output import StructuredOutputsParams
from tokenmill.structured_output.bitmask import allocate_bitmask, apply_bitmask

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 24},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]}},
        "required": ["name", "address"]},
    "arrays": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 4},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}},
        "required": ["tags", "scores"]},
    "enums": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]}},
        "required": ["color", "size"]},
    "ranges": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "year": {"type": "integer", "exclusiveMinimum": 1900, "exclusiveMaximum": 2100}},
        "required": ["age", "ratio", "year"]},
    "patterns": {"type": "object", "properties": {
        "phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}, "required": ["phone", "code"]},
    "optional": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000}, "note": {"type": "string", "maxLength": 16},
        "done": {"type": "boolean"}}, "required": ["id"], "additionalProperties": False},
    "refs": {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"]}},
        "type": "object", "properties": {"start": {"$ref": "#/$defs/point"},
                                         "path": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 3}},
        "required": ["start", "path"]},
    "any_of": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "null"}]},
        "unit": {"type": "string", "enum": ["kg", "m"]}}, "required": ["value", "unit"]},
}
PLAIN = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,", "Once upon a time,"]


@pytest.fixture(scope="module")
def engine(loaded_model, tokenizer) -> LLMEngine:  # noqa: ANN001
    return LLMEngine.from_loaded(EngineConfig(quantization="none"), loaded_model, tokenizer)


def chat(engine: LLMEngine, text: str) -> dict:
    return {"prompt_token_ids": engine.tokenizer.encode_chat([{"role": "user", "content": text}])}


def schema_prompt(engine: LLMEngine, name: str) -> dict:
    return chat(engine, f"Reply with a JSON object ({name}) following this schema: {json.dumps(SCHEMAS[name])}")


def constrained(max_tokens: int = 160, temperature: float = 0.0, seed: int | None = None,
                **constraint: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          structured_outputs=StructuredOutputsParams(**constraint))  # type: ignore[arg-type]


# ------------------------------------------------------------------ the mask itself


@pytest.mark.parametrize("native", [True, False])
def test_bitmask_masks_exactly_the_cleared_bits(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if native:
        assert kernels.token_bitmask_supported(torch.zeros(1, 8)), "the C kernel should build here"
    else:
        monkeypatch.setattr(kernels, "token_bitmask_supported", lambda logits: False)
    generator = torch.Generator().manual_seed(0)
    vocab = 1000
    bitmask = allocate_bitmask(3, vocab)
    bitmask.copy_(torch.randint(-2**31, 2**31 - 1, bitmask.shape, generator=generator, dtype=torch.int64).int())
    bitmask[0, 3], bitmask[1, 4] = 0, -1  # whole words: none allowed, all allowed
    logits = torch.randn(5, vocab, generator=generator)
    before = logits.clone()
    apply_bitmask(logits, torch.tensor([0, 2, 4]), bitmask)
    for bitmask_row, logits_row in zip(range(3), (0, 2, 4)):
        words = bitmask[bitmask_row].tolist()
        allowed = torch.tensor([(words[t // 32] >> (t % 32)) & 1 == 1 for t in range(vocab)])
        assert torch.equal(logits[logits_row][allowed], before[logits_row][allowed])
        assert torch.all(logits[logits_row][~allowed] == float("-inf"))
    assert torch.equal(logits[[1, 3]], before[[1, 3]])


def test_params_take_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="only one kind"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="needs one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    # a schema's text and its object share a key; key order matters (properties come out in that order)
    assert (StructuredOutputsParams(json='{"b":1, "a": {"type": "object"}}').key()
            == StructuredOutputsParams(json={"b": 1, "a": {"type": "object"}}).key()
            != StructuredOutputsParams(json={"a": {"type": "object"}, "b": 1}).key())
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == StructuredOutputsParams(regex="a+")


@pytest.mark.parametrize(("constraint", "message"), [
    ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "strin"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "a(b"}, "unclosed group"),
    ({"grammar": "start: foo"}, "foo"),
    ({"json": {"type": "string", "pattern": "[a-"}}, "unclosed character class"),
])
def test_invalid_constraints_are_rejected_with_the_librarys_message(engine: LLMEngine, constraint: dict,
                                                                     message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.add_request(None, "Hi", constrained(**constraint))
    assert not engine.has_unfinished_requests()


# ------------------------------------------------------------------ outputs on the bundled model


def test_json_schema_suite_validates_greedy_and_sampled_batched_with_unconstrained(engine: LLMEngine) -> None:
    unconstrained = SamplingParams(max_tokens=24, temperature=0)
    alone = run(engine, PLAIN, [unconstrained] * len(PLAIN))
    prompts, params = [], []
    for name, schema in SCHEMAS.items():
        prompts += [schema_prompt(engine, name)] * 2
        params += [constrained(json=schema), constrained(json=schema, temperature=1.0, seed=7)]
    outs = run(engine, prompts + PLAIN, params + [unconstrained] * len(PLAIN))
    for (name, schema), pair in zip(SCHEMAS.items(), zip(outs[0::2], outs[1::2])):
        for out in pair:
            assert out.finish_reason == "stop", (name, out.text)
            jsonschema.validate(json.loads(out.text), schema)
    # the unconstrained requests got exactly the tokens they get without constrained neighbours
    assert [o.token_ids for o in outs[-len(PLAIN):]] == [o.token_ids for o in alone]
    # and a constrained request alone gets the tokens it got in the batch
    for name in ("refs", "patterns"):
        index = 2 * list(SCHEMAS).index(name)
        assert run(engine, [prompts[index]], [params[index]])[0].token_ids == outs[index].token_ids


def test_regex_choice_and_grammars(engine: LLMEngine) -> None:
    cases = [
        ({"regex": r"[0-9]{3}-[0-9]{4}"}, "Give me a phone number.", re.compile(r"[0-9]{3}-[0-9]{4}")),
        ({"regex": r"(yes|no), because [a-z ]{5,30}\."}, "Is the sky blue? Answer and explain.",
         re.compile(r"(yes|no), because [a-z ]{5,30}\.")),
        ({"choice": ["Positive", "Negative", "Neutral"]}, "Sentiment of 'I love this film!'?",
         re.compile("Positive|Negative|Neutral")),
        ({"grammar": 'start: "(" NUM " " OP " " NUM ")"\nNUM: /[0-9]{1,3}/\nOP: "+" | "-" | "*"'},
         "Write an arithmetic expression.", re.compile(r"\([0-9]{1,3} [+*-] [0-9]{1,3}\)")),
        ({"grammar": 'root ::= "[" item ("," item)* "]"\nitem ::= [a-z]+'},  # llama.cpp's GBNF
         "List some fruits.", None),
        ({"json_object": True}, "Give a JSON object with a cat's name and age, nothing else.", None),
    ]
    prompts, params = [], []
    for constraint, question, _ in cases:
        prompts += [chat(engine, question)] * 2
        max_tokens = 400 if "json_object" in constraint else 60  # free-form JSON can take a while to close
        params += [constrained(max_tokens=max_tokens, **constraint),
                   constrained(max_tokens=max_tokens, temperature=1.0, seed=3, **constraint)]
    outs = run(engine, prompts, params)
    for i, (constraint, _, pattern) in enumerate(cases):
        for out in outs[2 * i:2 * i + 2]:
            assert out.finish_reason == "stop", (constraint, out.text)
            if pattern is not None:
                assert pattern.fullmatch(out.text), (constraint, out.text)
            elif "json_object" in constraint:
                assert isinstance(json.loads(out.text), dict)
            else:
                assert re.fullmatch(r"\[[a-z]+(,[a-z]+)*\]", out.text), out.text


def test_a_grammar_that_cannot_finish_ends_at_max_tokens(engine: LLMEngine) -> None:
    out = run(engine, [schema_prompt(engine, "nested")], [constrained(max_tokens=5, json=SCHEMAS["nested"])])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text.startswith("{")


def test_speculation_on_constrained_requests_is_token_identical(loaded_model, tokenizer,  # noqa: ANN001
                                                                engine: LLMEngine) -> None:
    spec = LLMEngine.from_loaded(EngineConfig(quantization="none", speculative_config={
        "num_speculative_tokens": 4, "min_acceptance_rate": 0.0}), loaded_model, tokenizer)
    prompts = [schema_prompt(engine, name) for name in ("refs", "arrays", "optional")]
    prompts.append(chat(engine, "Repeat exactly: [1, 2, 3, 1, 2, 3, 1, 2, 3]"))
    params = [constrained(json=SCHEMAS[name]) for name in ("refs", "arrays", "optional")]
    params.append(constrained(max_tokens=40, regex=r"\[([0-9], )*[0-9]\]"))
    expected = run(engine, prompts, params)
    got = run(spec, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert spec.core.scheduler.spec.accepted_tokens > 0


def test_grammars_compile_once_and_off_the_step_loop(loaded_model, tokenizer) -> None:  # noqa: ANN001
    engine = LLMEngine.from_loaded(EngineConfig(quantization="none"), loaded_model, tokenizer)
    manager = engine.structured_output
    release = threading.Event()
    compiled: list[str] = []
    real_compile = manager._compile

    def slow_compile(definition: str):  # noqa: ANN202
        release.wait(30)
        compiled.append(definition)
        return real_compile(definition)

    manager._compile = slow_compile  # type: ignore[method-assign]
    schema = SCHEMAS["enums"]
    first = engine.add_request(None, schema_prompt(engine, "enums"), constrained(json=schema))
    plain = engine.add_request(None, "The capital of France is", SamplingParams(max_tokens=8, temperature=0))
    produced: dict[str, int] = {first: 0, plain: 0}
    for _ in range(12):  # the unconstrained request runs to its end while the grammar is stuck compiling
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
    assert produced == {first: 0, plain: 8}
    second = engine.add_request(None, schema_prompt(engine, "enums"), constrained(json=schema, temperature=1.0,
                                                                                  seed=1))
    release.set()
    texts = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                texts[out.request_id] = out.outputs[0].text
    for request_id in (first, second):
        jsonschema.validate(json.loads(texts[request_id]), schema)
    assert len(compiled) == 1  # the second request reused the first one's compilation


def test_an_engine_core_reads_its_tokenizer_only_for_its_first_grammar(monkeypatch: pytest.MonkeyPatch) -> None:
    # a core process's front end tokenizes: the core's own tokenizer is read at the first grammar, not at start
    reads: list[str] = []
    real_from_path = Tokenizer.from_path

    def counted(*args, **kwargs) -> Tokenizer:  # noqa: ANN002, ANN003
        reads.append(str(args[0]))
        return real_from_path(*args, **kwargs)

    monkeypatch.setattr(Tokenizer, "from_path", counted)
    core = engine_core_from_config(EngineConfig(quantization="none"))
    assert reads == []
    grammars = core.scheduler.grammars
    assert grammars.manager is not None
    first = grammars.manager.start(StructuredOutputsParams(choice=["yes", "no"]))
    first.pending.result(timeout=60)
    second = grammars.manager.start(StructuredOutputsParams(regex="[0-9]+"))
    second.pending.result(timeout=60)
    assert len(reads) == 1 and first.ready and second.ready and first.grammar and second.grammar
    assert first.failure is None and second.failure is None


def test_walking_proposals_leaves_the_grammar_where_it_was(engine: LLMEngine) -> None:
    manager = engine.structured_output
    request = manager.start(StructuredOutputsParams(regex="xab|xyz"))
    request.pending.result(timeout=30)
    assert request.ready and request.grammar is not None
    grammar = request.grammar
    x, ab = engine.tokenizer.encode("x", False), engine.tokenizer.encode("ab", False)
    assert len(x) == 1 and len(ab) == 1
    assert grammar.accept(x[0])
    eos = engine.eos_token_ids[0]
    # proposals running to the grammar's end and past it (EOS, then anything)
    bitmask = manager.grammar_bitmask([(grammar, [ab[0], eos, ab[0]])])
    allowed = lambda row: {t for t in range(manager.vocab_size) if (int(bitmask[row, t // 32]) >> (t % 32)) & 1}  # noqa: E731
    assert ab[0] in allowed(0) and eos not in allowed(0)
    assert allowed(1) == allowed(2) == allowed(3) == set(engine.eos_token_ids)  # <|im_end|>, <|endoftext|>
    assert not grammar.is_terminated and grammar.accept(ab[0]) and grammar.is_terminated
