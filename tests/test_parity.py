"""Greedy parity with HF transformers on the bundled model (float32, same GGUF weights)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import CHAT_PROMPTS, DEVICE, PLAIN_PROMPTS
from tokenmill import SamplingParams

NEW_TOKENS = 48


def _hf_greedy(hf_model, prompt_ids: list[int]) -> list[int]:  # noqa: ANN001
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                                dtype=torch.long), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer, hf_tokenizer) -> list[list[int]]:  # noqa: ANN001
    ids = [hf_tokenizer(p, add_special_tokens=True).input_ids for p in PLAIN_PROMPTS]
    ids += [hf_tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
            for m in CHAT_PROMPTS]
    return [list(x) for x in ids]


def test_prompt_set_covers_the_required_range(prompt_ids: list[list[int]]) -> None:
    lengths = sorted(len(p) for p in prompt_ids)
    assert len(prompt_ids) >= 20
    assert lengths[0] == 1 and 900 <= lengths[-1] <= 1100, lengths


def test_greedy_tokens_match_transformers(llm, hf_model, prompt_ids: list[list[int]]) -> None:  # noqa: ANN001
    # min_tokens masks EOS exactly as transformers' min_new_tokens does, so every prompt yields 48 tokens.
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params)
    mismatches = []
    for ids, out in zip(prompt_ids, outputs):
        expected = _hf_greedy(hf_model, ids)
        if out.outputs[0].token_ids != expected:
            mismatches.append((len(ids), out.outputs[0].token_ids, expected))
    assert not mismatches, mismatches


def test_first_step_logits_match_transformers(loaded_model, hf_model, prompt_ids) -> None:  # noqa: ANN001
    from tokenmill.config import EngineConfig
    from tokenmill.core.outputs import ScheduledRequest, SchedulerOutput
    from tokenmill.executor.model_runner import ModelRunner

    config = EngineConfig(num_kv_blocks=80, device=DEVICE, quantization="none")
    runner = ModelRunner(config, loaded_model.config, loaded_model.weights)
    ids = prompt_ids[-4]  # a long one
    table = list(range(-(-len(ids) // 16)))
    plan = SchedulerOutput([ScheduledRequest("a", ids, 0, table, True, SamplingParams(), ids, [])])
    _, logits = runner.compute_logits(plan)
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0, -1]
    assert logits is not None
    assert (logits[0].cpu() - expected).abs().max() / expected.abs().max() < 1e-4
