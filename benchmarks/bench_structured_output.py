"""Structured outputs: what a grammar costs. Step time with every row constrained vs none (batch 1 and 32, decode
steps, side by side in one run), where the extra time goes (bitmask fill, mask application), and grammar compile
time per schema, cold and cached. With `--compare-engines`, the grammar libraries measured on the same schemas
(whichever of llguidance and xgrammar are installed; xgrammar is not a dependency). Writes the
`structured_output` section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import tokenmill.executor.model_runner as model_runner
from tokenmill.bench.machine import memory_bandwidth_gbs
from tokenmill.bench.report import machine_description, markdown_table, write_section
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.model.loader import load_model
from tokenmill.model.tokenizer import Tokenizer
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_output import StructuredOutputManager, StructuredOutputsParams
from tokenmill.structured_output.backend import Grammar

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat (3 fields)": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"}},
        "required": ["name", "age"]},
    "enums + ranges": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "integer", "minimum": 1, "maximum": 10},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["color", "size"]},
    "patterns": {"type": "object", "properties": {
        "phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}, "required": ["phone", "zip", "code"]},
    "nested + $refs": {"$defs": {"address": {"type": "object", "properties": {
        "street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["street", "city"]}}, "type": "object", "properties": {
        "name": {"type": "string"}, "home": {"$ref": "#/$defs/address"}, "work": {"$ref": "#/$defs/address"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5}},
        "required": ["name", "home"]},
}
# Never finishes within the measured tokens (at least 100 items), so every row stays constrained.
ENDLESS = {"type": "object", "properties": {"items": {"type": "array", "minItems": 100, "maxItems": 1000, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                     "qty": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "qty"]}}}, "required": ["items"]}


class Timer:
    """Wraps a function and adds up the seconds spent in it."""

    def __init__(self, owner: Any, name: str) -> None:
        self.seconds = 0.0
        self.calls = 0
        inner: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        setattr(owner, name, timed)


def decode_steps(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[float]:
    """Seconds of every pure-decode step while all the requests run."""
    for prompt in prompts:
        engine.add_request(None, {"prompt_token_ids": prompt}, params)
    seconds = []
    while engine.has_unfinished_requests():
        engine.step()
        step = engine.core.last_step
        assert step is not None
        if step.stats.num_prefill_tokens == 0 and step.stats.num_running == len(prompts):
            seconds.append(step.seconds)
    return seconds


def step_rows(engine: LLMEngine, tokenizer: Tokenizer, batches: list[int], max_tokens: int,
              rounds: int) -> list[list[object]]:
    question = "List the items of a grocery order as JSON: an `items` array of {name, qty} objects."
    prompt = tokenizer.encode_chat([{"role": "user", "content": question}])
    plain = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=max_tokens, temperature=0,
                                 structured_outputs=StructuredOutputsParams(json=ENDLESS))
    fill = Timer(engine.structured_output, "grammar_bitmask")
    apply = Timer(model_runner, "apply_bitmask")
    advance = Timer(Grammar, "accept")
    decode_steps(engine, [prompt], constrained)  # warm-up: compiles the grammar, builds the vocabulary index
    rows: list[list[object]] = []
    for batch in batches:
        prompts = [prompt] * batch
        times: dict[str, list[float]] = {"none": [], "all": []}
        fill_s = apply_s = advance_s = 0.0
        for _ in range(rounds):  # alternate, so drifts in machine speed hit both sides
            times["none"] += decode_steps(engine, prompts, plain)
            fill.seconds = apply.seconds = advance.seconds = 0.0
            fill.calls = 0
            steps = decode_steps(engine, prompts, constrained)
            times["all"] += steps
            fill_s += fill.seconds / max(1, fill.calls)
            apply_s += apply.seconds / max(1, fill.calls)
            advance_s += advance.seconds / max(1, fill.calls)
        none_ms, all_ms = (1e3 * statistics.median(times[k]) for k in ("none", "all"))
        rows.append([batch, round(none_ms, 2), round(all_ms, 2), f"{all_ms / none_ms:.3f}",
                     round(1e3 * fill_s / rounds, 3), round(1e3 * apply_s / rounds, 3),
                     round(1e3 * advance_s / rounds, 3)])
        print(rows[-1], flush=True)
    return rows


def compile_rows(tokenizer: Tokenizer, vocab_size: int, eos: tuple[int, ...]) -> tuple[float, list[list[object]]]:
    manager = StructuredOutputManager(lambda: (tokenizer.backend, eos), vocab_size)
    start = time.perf_counter()
    manager.start(StructuredOutputsParams(regex="a")).pending.result()  # builds the token index once
    tokenizer_s = time.perf_counter() - start
    rows: list[list[object]] = []
    for name, schema in SCHEMAS.items():
        params = StructuredOutputsParams(json=schema)

        def ready(params: StructuredOutputsParams = params) -> float:
            start = time.perf_counter()
            manager.validate(params)
            request = manager.start(params)
            request.pending.result()
            assert request.ready and request.grammar is not None
            return time.perf_counter() - start

        cold = ready()
        cached = statistics.median(ready() for _ in range(20))
        rows.append([name, round(cold * 1e3, 2), round(cached * 1e6, 1)])
        print(rows[-1], flush=True)
    manager.shutdown()
    return tokenizer_s, rows


def compare_engines(tokenizer: Tokenizer, vocab_size: int, eos: int) -> list[list[object]]:
    """Compile, mask fill and mask application per library, on the SCHEMAS, walking a valid output of each."""
    from tokenmill.structured_output.backend import GrammarCompiler, grammar_definition
    from tokenmill.structured_output.bitmask import allocate_bitmask, apply_bitmask

    samples = {
        "flat (3 fields)": {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"},
        "enums + ranges": {"color": "green", "size": 7, "ratio": 0.25},
        "patterns": {"phone": "555-0123", "zip": "75001", "code": "FR75"},
        "nested + $refs": {"name": "Bob", "home": {"street": "1 Main St", "city": "Springfield", "zip": "12345"},
                           "work": {"street": "2 Side Rd", "city": "Shelbyville"}, "tags": ["a", "b"]},
    }
    texts = {name: json.dumps(sample) for name, sample in samples.items()}  # ", " and ": " separators
    rows: list[list[object]] = []
    logits = torch.randn(1, vocab_size)

    def measure(label: str, compile_one: Callable[[str], Any], fill: Callable[[Any, torch.Tensor], None],
                accept: Callable[[Any, int], bool]) -> None:
        compile_ms, fill_us, apply_us = [], [], []
        bitmask = allocate_bitmask(1, vocab_size)
        for name in SCHEMAS:
            start = time.perf_counter()
            matcher = compile_one(name)
            compile_ms.append((time.perf_counter() - start) * 1e3)
            for token in tokenizer.encode(texts[name], add_special_tokens=False):
                start = time.perf_counter()
                fill(matcher, bitmask)
                fill_us.append((time.perf_counter() - start) * 1e6)
                start = time.perf_counter()
                apply_bitmask(logits, torch.tensor([0]), bitmask)
                apply_us.append((time.perf_counter() - start) * 1e6)
                assert accept(matcher, token), (label, name, tokenizer.decode([token]))
        rows.append([label, round(statistics.median(compile_ms), 2), round(statistics.median(fill_us), 1),
                     round(statistics.median(apply_us), 1)])
        print(rows[-1], flush=True)

    compiler = GrammarCompiler(tokenizer.backend.to_str(), vocab_size, [eos])
    measure("llguidance",
            lambda name: Grammar(compiler.compile(grammar_definition("json", json.dumps(SCHEMAS[name])))),
            lambda g, bitmask: g.fill_bitmask(bitmask, 0), lambda g, token: g.accept(token))
    try:
        import xgrammar
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        rows.append(["xgrammar", "not installed", "-", "-"])
        return rows
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend, eos_token=tokenizer.eos_token)
    xgr = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size),
                                   max_threads=1, cache_enabled=False)
    measure("xgrammar", lambda name: xgrammar.GrammarMatcher(xgr.compile_json_schema(
        json.dumps(SCHEMAS[name]), any_whitespace=False, separators=(", ", ": "))),
        lambda m, bitmask: m.fill_next_token_bitmask(bitmask, 0), lambda m, token: m.accept_token(token))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--compare-engines", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    loaded = load_model(None)
    tokenizer = Tokenizer.from_path(loaded.path, loaded.gguf_reader)
    engine = LLMEngine.from_loaded(EngineConfig(quantization=args.quantization), loaded, tokenizer)
    bandwidth = memory_bandwidth_gbs()
    steps = step_rows(engine, tokenizer, args.batches, args.max_tokens, args.rounds)
    tokenizer_s, compiles = compile_rows(tokenizer, engine.vocab_size, engine.eos_token_ids)
    body = [
        "## Structured outputs (`python benchmarks/bench_structured_output.py`)", "",
        f"Machine: {machine_description()}; memory {bandwidth:.1f} GB/s measured in the same run. "
        f"`--quantization {args.quantization}`, grammar engine llguidance. Median decode-step time with every row "
        f"unconstrained vs every row under a JSON schema (an array of objects that does not close within the "
        f"{args.max_tokens} tokens measured), the two alternated {args.rounds} times. Fill: the step's bitmask "
        "(one llguidance mask per constrained row, on the scheduler's thread); apply: masking the logits rows; "
        "advance: feeding each emitted token to its matcher.", "",
        markdown_table(["batch", "unconstrained ms/step", "all constrained ms/step", "ratio", "fill ms/step",
                        "apply ms/step", "advance ms/step"], steps), "",
        f"Grammar compile (front-end validation + matcher; the vocabulary index is built once per engine, "
        f"{tokenizer_s:.2f} s, in the grammar worker at the first constrained request):", "",
        markdown_table(["schema", "cold ms", "cached us"], compiles),
    ]
    if args.compare_engines:
        engines = compare_engines(tokenizer, engine.vocab_size, engine.eos_token_ids[0])
        body += ["", "Grammar engines on the same schemas (`--compare-engines`; medians over the tokens of a valid "
                 "output of each schema; apply is tokenmill's own bitmask application in both):", "",
                 markdown_table(["engine", "compile ms", "mask fill us/token", "apply us/row"], engines)]
    if not args.no_write:
        write_section("structured_output", "\n".join(body))
        print("wrote docs/BENCHMARKS.md (structured_output)")


if __name__ == "__main__":
    main()
