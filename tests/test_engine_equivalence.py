"""End to end on the bundled model: 64 requests of mixed lengths, arriving staggered, give exactly the greedy
tokens each gives alone, under heavy chunking, preemption, prefix caching, and the dynamic and static modes."""

from __future__ import annotations

import random

import pytest

from tests.conftest import DEVICE, LONG_PARAGRAPH
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

NUM_REQUESTS = 64


@pytest.fixture(scope="module")
def workload(tokenizer) -> list[tuple[list[int], SamplingParams]]:  # noqa: ANN001
    rng = random.Random(7)
    words = (LONG_PARAGRAPH * 4).split()
    shared = tokenizer.encode_chat([{"role": "system", "content": LONG_PARAGRAPH},
                                    {"role": "user", "content": "Question:"}], add_generation_prompt=False)
    requests = []
    for i in range(NUM_REQUESTS):
        n_words = rng.choice([1, 3, 8, 20, 45, 90])
        start = rng.randrange(len(words) - n_words)
        text = f"Note {i}: " + " ".join(words[start:start + n_words])
        ids = tokenizer.encode(text)
        if i % 3 == 0:  # a third share a long chat prefix
            ids = shared + ids
        max_tokens = rng.choice([1, 2, 4, 8, 12, 16])
        requests.append((ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
    return requests


def make_engine(loaded_model, tokenizer, **config) -> LLMEngine:  # noqa: ANN001
    return LLMEngine.from_loaded(EngineConfig(device=DEVICE, **config), loaded_model, tokenizer)


@pytest.fixture(scope="module")
def alone_outputs(loaded_model, tokenizer, workload) -> list[list[int]]:  # noqa: ANN001
    engine = make_engine(loaded_model, tokenizer, num_kv_blocks=128, enable_prefix_caching=False)
    results = []
    for i, (ids, params) in enumerate(workload):
        engine.add_request(f"alone{i}", {"prompt_token_ids": ids}, params)
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens = out.outputs[0].token_ids
        results.append(tokens)
    return results


def run_staggered(engine: LLMEngine, workload) -> dict[int, list[int]]:  # noqa: ANN001
    """Four requests at first, then two more every step."""
    pending = list(enumerate(workload))
    done: dict[int, list[int]] = {}
    first, pending = pending[:4], pending[4:]
    for i, (ids, params) in first:
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    while pending or engine.has_unfinished_requests():
        for i, (ids, params) in pending[:2]:
            engine.add_request(str(i), {"prompt_token_ids": ids}, params)
        pending = pending[2:]
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs[0].token_ids
        engine.scheduler.check_integrity()
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks
    return done


CASES = {
    "tiny-budget": dict(max_num_batched_tokens=24, max_num_seqs=16, num_kv_blocks=512, enable_prefix_caching=False),
    "preemption": dict(max_num_batched_tokens=256, max_num_seqs=32, num_kv_blocks=40, enable_prefix_caching=False),
    "prefix-caching": dict(max_num_batched_tokens=256, max_num_seqs=32, num_kv_blocks=512),
    "dynamic": dict(batching="dynamic", max_num_seqs=16, num_kv_blocks=512),
    "static": dict(batching="static", max_num_seqs=16, num_kv_blocks=512),
}


@pytest.mark.parametrize("case", list(CASES))
def test_batched_outputs_equal_alone(case: str, loaded_model, tokenizer, workload, alone_outputs) -> None:  # noqa: ANN001
    engine = make_engine(loaded_model, tokenizer, **CASES[case])
    done = run_staggered(engine, workload)
    assert sorted(done) == list(range(NUM_REQUESTS))
    mismatched = [i for i in range(NUM_REQUESTS) if done[i] != alone_outputs[i]]
    assert not mismatched, [(i, done[i], alone_outputs[i]) for i in mismatched[:3]]
    steps = engine.core.num_steps
    if case == "tiny-budget":
        assert steps > sum(len(ids) for ids, _ in workload) // 24
    if case == "preemption":
        assert engine.scheduler.total_preemptions > 0
    if case == "prefix-caching":
        assert engine.core.kv.prefix_hits > 0
