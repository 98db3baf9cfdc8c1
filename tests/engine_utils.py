"""Running an LLMEngine to completion in tests, checking it leaks nothing."""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.engine.llm_engine import LLMEngine, PromptType
from tokenmill.outputs import CompletionOutput
from tokenmill.sampling_params import SamplingParams


def run_engine(engine: LLMEngine, prompts: Sequence[PromptType],
               params: SamplingParams | Sequence[SamplingParams]) -> list[CompletionOutput]:
    """Each prompt's first completion, in order; afterwards the scheduler is consistent and every KV block free."""
    param_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, param_list)]
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0]
    engine.core.scheduler.check_integrity()
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks
    return [outputs[i] for i in ids]
