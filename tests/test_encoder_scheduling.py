"""An encoder's inputs go through the engine's Scheduler: whole inputs (no chunks) under the token budget and
the sequence cap, in arrival order, each step one packed forward; a failed step fails only its requests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_embeddings import TEXTS, _tiny
from tokenmill.config import EngineConfig
from tokenmill.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenmill.encoder.engine import EmbeddingEngine
from tokenmill.encoder.inputs import EncoderInput
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

BUDGET = 48
POOL = SamplingParams(max_tokens=1, temperature=0.0, pool=True)


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("encoder") / "bert"
    _tiny("bert", path)
    return path


def _recording(engine: EmbeddingEngine) -> list[SchedulerOutput]:
    plans: list[SchedulerOutput] = []
    runner = engine.core.executor
    execute = runner.execute

    def record(plan: SchedulerOutput) -> ModelRunnerOutput:
        plans.append(plan)
        return execute(plan)

    runner.execute = record  # type: ignore[method-assign]
    return plans


def test_inputs_run_whole_under_the_token_budget_and_equal_alone(bert: Path) -> None:
    engine = EmbeddingEngine(EngineConfig(model=str(bert), quantization="none", max_model_len=BUDGET,
                                          max_num_batched_tokens=BUDGET, max_num_seqs=3))
    try:
        alone = [engine.embed([text])[0] for text in TEXTS]
        plans = _recording(engine)
        inputs = [engine.make_input(t, truncate_prompt_tokens=BUDGET) for t in TEXTS]
        futures = [engine.submit(inputs[:3]), engine.submit(inputs[3:]), engine.submit(inputs[::-1])]
        together = [f.result(timeout=60) for f in futures]
        rows = [*together[0], *together[1]]
        for ours, expected in zip(rows + list(together[2].flip(0)), alone + alone, strict=True):
            assert torch.allclose(ours, expected, atol=1e-5)
        assert len(plans) >= 4  # 10 inputs, at most 3 a step
        for plan in plans:
            assert plan.scheduled and len(plan.scheduled) <= 3 and plan.total_tokens <= BUDGET
            lengths = {len(i.token_ids) for i in inputs}
            assert all(s.start_position == 0 and s.sample and s.num_tokens in lengths for s in plan.scheduled)
        scheduler = engine.core.scheduler
        assert not scheduler.requests and engine.core.kv.num_free_blocks == engine.core.kv.num_blocks
        assert engine.stats.requests == len(TEXTS) + 3 and engine.stats.batches >= len(TEXTS) + len(plans)
    finally:
        engine.shutdown()


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(bert: Path) -> None:
    engine = EmbeddingEngine(EngineConfig(model=str(bert), quantization="none"))
    runner: Any = engine.core.executor
    execute = runner.execute
    poison = engine.make_input(TEXTS[1]).token_ids

    def failing(plan: SchedulerOutput) -> ModelRunnerOutput:
        if any(s.token_ids == poison for s in plan.scheduled):
            raise RuntimeError("boom")
        return execute(plan)

    runner.execute = failing
    try:
        with pytest.raises(RuntimeError, match="boom"):
            engine.embed(TEXTS[:2])
        assert engine.embed([TEXTS[2]]).shape == (1, 64)
        assert not engine.core.scheduler.requests and engine.core.kv.num_free_blocks == engine.core.kv.num_blocks
    finally:
        engine.shutdown()


def test_refused_inputs_and_a_broken_loop_fail_their_requests_only(bert: Path) -> None:
    engine = EmbeddingEngine(EngineConfig(model=str(bert), quantization="none", max_model_len=64))
    try:
        too_long = EncoderInput(list(range(5, 5 + 65)))  # past the checks of make_input: the scheduler refuses it
        with pytest.raises(ValueError, match="maximum context length is 64"):
            engine.submit([engine.make_input(TEXTS[0]), too_long]).result(timeout=60)
        collect = engine._collect

        def broken(output: Any) -> None:
            engine._collect = collect  # type: ignore[method-assign]
            raise RuntimeError("broken")

        engine._collect = broken  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="broken"):
            engine.embed([TEXTS[1]])
        assert engine.embed([TEXTS[2]]).shape == (1, 64)  # the loop goes on
        assert not engine.core.scheduler.requests and engine.core.kv.num_free_blocks == engine.core.kv.num_blocks
    finally:
        engine.shutdown()


def test_an_encoder_engine_takes_embedding_requests_only(bert: Path) -> None:
    engine = LLMEngine.from_config(EngineConfig(model=str(bert), quantization="none", task="embed"))
    ids = engine.tokenizer.encode("the cat")
    assert ids[0] == 2 and ids[-1] == 3  # [CLS] ... [SEP], as the model reads it
    with pytest.raises(ValueError, match="encoder"):
        engine.add_request("gen", {"prompt_token_ids": ids}, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="token_type_ids"):
        engine.add_request("types", {"prompt_token_ids": ids, "token_type_ids": [0, 7, 0, 0]}, POOL)
    engine.add_request("ok", {"prompt_token_ids": ids, "token_type_ids": [0, 0, 1, 1]}, POOL)
    outputs = [o for _ in range(3) for o in engine.step()]
    assert [o.request_id for o in outputs] == ["ok"] and len(outputs[0].pooled or []) == 64
    decoder = LLMEngine.from_config(EngineConfig(quantization="none", num_kv_blocks=64))
    with pytest.raises(ValueError, match="decoder"):
        decoder.add_request("types", {"prompt_token_ids": [1, 2], "token_type_ids": [0, 0]}, POOL)
