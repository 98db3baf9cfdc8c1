"""Sampler: filters against transformers' warpers and a known distribution, penalties against transformers'
processors, seeds independent of batch composition, logprobs, and parameter validation."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tokenmill import SamplingParams
from tokenmill.executor.sampler import Sampler, SamplingRow, apply_penalties, filter_logits

VOCAB = 64


def _row(params: SamplingParams, seed: int | None = 0, prompt=(1, 2, 3), output=()) -> SamplingRow:  # noqa: ANN001
    gen = None
    if not params.greedy:
        gen = torch.Generator()
        gen.manual_seed(seed if seed is not None else 0)
    return SamplingRow(params, list(prompt), list(output), gen)


@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.1), (10, 0.9, 0.05),
                                                (1, 1.0, 0.0), (0, 0.3, 0.0)])
def test_filters_match_transformers_warpers(top_k: int, top_p: float, min_p: float) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB) * 3
    ours = filter_logits(logits.clone(), torch.full((4,), top_k), torch.full((4,), top_p), torch.full((4,), min_p))
    expected = logits.clone()
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(None, expected)
    if min_p:
        expected = MinPLogitsWarper(min_p)(None, expected)
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    kept = ~torch.isinf(ours)
    assert torch.equal(ours[kept], logits[kept])


def test_filters_on_a_known_distribution() -> None:
    probs = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04]])
    logits = probs.log()

    def kept(top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> list[int]:
        out = filter_logits(logits.clone(), torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))
        return torch.nonzero(~torch.isinf(out[0])).flatten().tolist()

    assert kept(top_k=2) == [0, 1]
    assert kept(top_p=0.5) == [0, 1]  # 0.40 < 0.5, so the second token is needed
    assert kept(top_p=0.7) == [0, 1, 2]  # 0.65 < 0.7 <= 0.80
    assert kept(top_p=0.1) == [0]
    assert kept(min_p=0.3) == [0, 1, 2]  # threshold 0.12
    assert kept(min_p=0.5) == [0, 1]  # threshold 0.20
    assert kept(top_k=4, top_p=0.9, min_p=0.3) == [0, 1, 2]


def test_sampling_frequencies_follow_the_filtered_distribution() -> None:
    probs = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
    logits = probs.log().repeat(4000, 1)
    params = SamplingParams(temperature=1.0, top_p=0.7)
    gen = torch.Generator()
    gen.manual_seed(1)
    rows = [SamplingRow(params, [], [], gen) for _ in range(4000)]
    tokens = torch.tensor(Sampler()(logits, rows).token_ids)
    freq = torch.bincount(tokens, minlength=6).float() / len(tokens)
    expected = torch.tensor([0.40, 0.25, 0.15, 0, 0, 0]) / 0.80
    assert (freq - expected).abs().max() < 0.03, freq


def test_temperature_sharpens_like_transformers() -> None:
    logits = torch.randn(1, VOCAB)
    expected = TemperatureLogitsWarper(0.5)(None, logits.clone())
    assert torch.allclose(expected, logits / 0.5)
    greedy = Sampler()(logits.clone(), [_row(SamplingParams(temperature=0.0))])
    assert greedy.token_ids == [int(logits.argmax())]
    # A very low temperature concentrates all mass on the argmax.
    cold = Sampler()(logits.repeat(8, 1), [_row(SamplingParams(temperature=0.01), seed=s) for s in range(8)])
    assert set(cold.token_ids) == {int(logits.argmax())}


def test_repetition_penalty_matches_transformers() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, VOCAB) * 4
    prompt, output = [3, 5, 7, 7], [9, 3, 11]
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    ours = apply_penalties(logits.clone(), [_row(params, prompt=prompt, output=output)])
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits.clone())
    assert torch.allclose(ours, expected)


def test_presence_and_frequency_penalties_follow_openai_formula() -> None:
    logits = torch.zeros(1, VOCAB)
    output = [4, 4, 4, 9]
    params = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25)
    ours = apply_penalties(logits.clone(), [_row(params, prompt=[1, 2], output=output)])
    expected = torch.zeros(1, VOCAB)
    expected[0, 4] = -(0.25 * 3 + 0.5)
    expected[0, 9] = -(0.25 * 1 + 0.5)
    assert torch.allclose(ours, expected)  # prompt tokens are not penalised by presence/frequency


def test_seeded_row_does_not_depend_on_batch_composition() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = [Sampler()(logits[2:3].clone(), [_row(params, seed=1234)]).token_ids[0] for _ in range(1)]
    mixed_rows = [_row(SamplingParams(temperature=0.8, seed=s), seed=s) for s in range(6)]
    mixed_rows[2] = _row(params, seed=1234)
    mixed = Sampler()(logits.clone(), mixed_rows).token_ids[2]
    assert alone[0] == mixed


def test_seeded_requests_reproducible_in_the_engine_whatever_else_runs(llm) -> None:  # noqa: ANN001
    params = SamplingParams(temperature=1.0, top_k=50, seed=42, max_tokens=24, ignore_eos=True)
    alone = llm.generate(["Write a short poem about rivers:"], params)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.9, max_tokens=n, ignore_eos=True) for n in (5, 30, 12)]
    batch = llm.generate(["Tell me about", "Write a short poem about rivers:", "A long story of a", "Why"],
                         [others[0], params, others[1], others[2]])
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate(["Write a short poem about rivers:"], params)[0].outputs[0].token_ids
    assert again == alone
    different = llm.generate(["Write a short poem about rivers:"],
                             SamplingParams(temperature=1.0, top_k=50, seed=43, max_tokens=24, ignore_eos=True))
    assert different[0].outputs[0].token_ids != alone


def test_logprobs_are_the_raw_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, VOCAB)
    out = Sampler()(logits.clone(), [_row(SamplingParams(temperature=0.0, logprobs=3)),
                                     _row(SamplingParams(temperature=0.7, logprobs=0), seed=3)])
    ref = logits.log_softmax(-1)
    first = out.logprobs[0]
    assert first is not None and len(first) == 3  # greedy: chosen token is the top-1, plus 2 more
    top3 = ref[0].topk(3)
    for value, token in zip(top3.values.tolist(), top3.indices.tolist()):
        assert math.isclose(first[token], value, rel_tol=1e-6)
    second = out.logprobs[1]
    assert second is not None and list(second) == [out.token_ids[1]]
    assert math.isclose(second[out.token_ids[1]], ref[1, out.token_ids[1]].item(), rel_tol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n must"),
    ({"logprobs": 50}, "logprobs"),
    ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
])
def test_invalid_parameters_raise_clear_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_min_tokens_masks_eos_and_stop_ids(llm) -> None:  # noqa: ANN001
    eos = llm.tokenizer.eos_token_id
    out = llm.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12))[0].outputs[0]
    assert len(out.token_ids) == 12 and eos not in out.token_ids
