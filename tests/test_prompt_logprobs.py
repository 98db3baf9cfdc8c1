"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' float32 log-softmax on the same weights:
whole prompts, prompts cut into chunks, prompts whose prefix is cached, and n > 1."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import LONG_PARAGRAPH
from tokenmill import LLM, SamplingParams
from tokenmill.outputs import RequestOutput

PROMPT = LONG_PARAGRAPH * 3 + "In short,"
TOP_N = 4


@pytest.fixture(scope="module")
def whole_llm() -> LLM:
    """Whole prompts in one step. Not the session's `llm`: the blocks these prompts leave in its prefix cache
    would change later tests' computation paths (a cached prefix, then a chunk)."""
    return LLM(quantization="none")


@pytest.fixture(scope="module")
def chunked_llm() -> LLM:
    """Prompts go in chunks of at most 32 tokens; the prefix cache is on."""
    return LLM(quantization="none", max_num_batched_tokens=32, enable_prefix_caching=True)


def reference(hf_model, token_ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


def assert_matches_transformers(output: RequestOutput, hf_model, top_n: int = TOP_N) -> None:  # noqa: ANN001
    ids = output.prompt_token_ids
    scored = output.prompt_logprobs
    assert scored is not None and len(scored) == len(ids) and scored[0] is None
    expected = reference(hf_model, ids)
    for position in range(1, len(ids)):
        entry = scored[position]
        assert entry is not None
        row = expected[position - 1]
        assert entry[ids[position]] == pytest.approx(float(row[ids[position]]), abs=1e-4), position
        top = row.topk(top_n)
        assert set(top.indices.tolist()) <= set(entry), position
        assert len(entry) <= top_n + 1
        for token, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[token] == pytest.approx(value, abs=1e-4)


def test_prompt_logprobs_of_a_whole_prompt_match_transformers(whole_llm: LLM, hf_model) -> None:  # noqa: ANN001
    [output] = whole_llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=TOP_N))
    assert len(output.prompt_token_ids) > 100
    assert_matches_transformers(output, hf_model)


def test_chunked_prefill_scores_every_chunk_as_the_whole_prompt(whole_llm: LLM, chunked_llm: LLM,
                                                                hf_model) -> None:  # noqa: ANN001
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=TOP_N)
    [whole] = whole_llm.generate(PROMPT, params)
    [chunked] = chunked_llm.generate(PROMPT, params)
    assert_matches_transformers(chunked, hf_model)
    assert whole.prompt_logprobs is not None and chunked.prompt_logprobs is not None
    for a, b in zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:]):
        assert a is not None and b is not None and a.keys() == b.keys()
        assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_a_cached_prefix_is_computed_again_for_its_logits(chunked_llm: LLM, hf_model) -> None:  # noqa: ANN001
    prompt = LONG_PARAGRAPH * 2 + "The cache"
    chunked_llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0))  # now its prefix is cached
    [scored] = chunked_llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    assert scored.num_cached_tokens == 0  # vLLM's rule: a cached block has no logits
    assert_matches_transformers(scored, hf_model, top_n=1)
    [plain] = chunked_llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0))
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None  # the cache still serves the others


def test_n_samples_share_one_scored_prompt(chunked_llm: LLM, hf_model) -> None:  # noqa: ANN001
    [output] = chunked_llm.generate("Once upon a time, in a land far away,",
                                    SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=7, prompt_logprobs=2))
    assert len(output.outputs) == 3 and all(len(c.token_ids) == 4 for c in output.outputs)
    assert_matches_transformers(output, hf_model, top_n=2)


def test_prompt_logprobs_are_validated() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
