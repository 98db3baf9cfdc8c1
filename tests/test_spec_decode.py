"""Speculative decoding: the n-gram proposer, rejection sampling's distribution, and the engine's outputs with
speculation against the same engine without it (greedy: token-identical)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests.conftest import CHAT_PROMPTS, LONG_PARAGRAPH, PLAIN_PROMPTS
from tests.engine_utils import run_engine
from tests.server_utils import live_server
from tokenmill.config import EngineConfig
from tokenmill.core.outputs import SchedulerOutput, SchedulerStats
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.metrics import metric_value
from tokenmill.spec_decode import SpeculativeConfig
from tokenmill.spec_decode.ngram import propose_ngram
from tokenmill.spec_decode.proposer import (
    COST_MARGIN,
    PROBE_INTERVAL,
    Proposer,
    StepCostModel,
    proposal_length,
    record_verification,
)
from tokenmill.spec_decode.rejection import verify_greedy, verify_random

# ------------------------------------------------------------------ proposer and configuration


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2, 3], 4, 2, 5) == [4, 5, 1, 2]
    assert propose_ngram([5, 1, 2, 3, 8, 1, 2, 3, 9, 2, 3], 3, 2, 5) == [9, 2, 3]  # latest of the matches
    assert propose_ngram([9, 1, 2, 7, 3, 1, 2, 3], 2, 1, 3) == [1, 2]  # the longest n wins: "2 3" is absent...
    assert propose_ngram([4, 2, 3, 8, 1, 2, 3], 2, 2, 3) == [8, 1]  # ...here "2 3" matches
    assert propose_ngram([1, 2, 3], 3, 2, 5) == []
    assert propose_ngram([7, 7, 7, 7], 3, 1, 3) == [7]  # the match may overlap the suffix


def test_speculative_config_parses_vllm_shapes_and_rejects_bad_ones() -> None:
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert config == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=4)
    assert EngineConfig(speculative_config={"num_speculative_tokens": 2}).speculative_config.num_speculative_tokens == 2
    for bad in ('{"method": "eagle"}', '{"quantization": "int3"}', '{"num_speculative_tokens": 0}',
                '{"prompt_lookup_min": 4, "prompt_lookup_max": 2}', '{"bogus": 1}', "not json"):
        with pytest.raises(ValueError):
            SpeculativeConfig.parse(bad)


def test_proposer_respects_batch_size_length_limit_and_sizes_proposals_by_acceptance() -> None:
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, disable_by_batch_size=3)
    proposer = Proposer(config, EngineConfig(), 64)

    def decoding(request_id: str, max_total: int) -> Request:
        request = Request(request_id, [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams())
        request.num_computed_tokens = request.num_tokens - 1
        request.max_total_tokens = max_total
        return request

    a, b = decoding("a", 100), decoding("b", 10)
    proposer.propose([a, b])
    assert a.spec_token_ids == [3, 1, 2] and b.spec_token_ids == [3]  # b may emit 2 more tokens at most
    proposer.propose([a, b, decoding("c", 100)])
    assert a.spec_token_ids == []  # three running: the batch is crowded enough
    for _ in range(30):  # every proposal rejected: the estimate falls below what a row costs
        record_verification(a, 4, 0)
    proposer.propose([a])
    assert a.spec_token_ids == []
    for _ in range(20):  # a row costs little alone: as the failures fade, it tries again
        proposer.propose([a])
    assert a.spec_token_ids
    for rows in [1, 3] * 10:  # rows as dear as the rest of a step: a request at the prior does not pay...
        proposer.cost.observe(rows, 1.0 + rows)
    for _ in range(PROBE_INTERVAL - 1):
        proposer.propose([a])
        assert a.spec_token_ids == []
    proposer.propose([a])  # ...but probes with one token now and then
    assert a.spec_token_ids == [3]
    proposer.cost = StepCostModel()
    proposer.pool_rejections = 30.0  # all requests' proposals fail: the pool's estimate falls, then recovers
    assert proposer.acceptance(decoding("x", 100)) < 0.1
    for _ in range(200):
        proposer.observe_step(SchedulerOutput([]), 0.0, SchedulerStats())
    assert proposer.acceptance(decoding("x", 100)) > 0.3
    for _ in range(30):  # every proposal accepted
        record_verification(a, 4, 4)
    proposer.propose([a])
    assert a.spec_token_ids == [3, 1, 2]
    fresh = decoding("d", 100)  # a new request starts from the others' acceptance
    proposer.pool_accepted, proposer.pool_rejections = 0.0, 30.0
    proposer.propose([fresh])
    assert fresh.spec_token_ids == []
    proposer.pool_accepted, proposer.pool_rejections = 90.0, 10.0
    proposer.propose([fresh])
    assert fresh.spec_token_ids == [3, 1, 2]


def test_proposal_length_follows_the_break_even_of_a_row() -> None:
    assert proposal_length(0.8, 0.05, 16) == 13  # 0.8^13 = 0.055 >= 0.05 > 0.8^14
    assert proposal_length(0.8, 0.05, 4) == 4
    assert proposal_length(0.5, 0.6, 4) == 0  # a crowded step: not even one token pays
    assert proposal_length(0.9, 0.6, 8) == 4
    model = StepCostModel()
    assert model.break_even(1) == pytest.approx(COST_MARGIN * 0.05 / 1.05)  # the prior until steps of several sizes
    for rows in [1, 5] * 20:  # T = 10 ms + 2 ms per row
        model.observe(rows, 0.010 + 0.002 * rows)
    assert model.row_cost_ratio() == pytest.approx(0.2)
    assert model.break_even(1) == pytest.approx(COST_MARGIN * 0.2 / 1.2)
    assert model.break_even(30) == 1.0  # 6 / 7 with the margin: nothing pays


# ------------------------------------------------------------------ verification


def test_greedy_verification_accepts_the_matching_prefix_plus_one() -> None:
    logits = torch.full((4, 10), -1.0)
    for row, token in enumerate([5, 6, 7, 8]):
        logits[row, token] = 1.0
    assert verify_greedy(logits, [5, 6, 7]) == [5, 6, 7, 8]
    assert verify_greedy(logits, [5, 9, 7]) == [5, 6]
    assert verify_greedy(logits, [1, 6, 7]) == [5]
    assert verify_greedy(logits[:1], []) == [5]


def _total_variation(samples: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    return 0.5 * float((counts / counts.sum() - probs.double()).abs().sum())


@pytest.mark.parametrize("proposer", ["point-likely", "point-unlikely", "draft-good", "draft-bad"])
def test_rejection_sampling_keeps_the_target_distribution(proposer: str) -> None:
    """20,000 draws of the first emitted token: its distribution is the target's, whatever the proposal
    (a deterministic token that p likes or dislikes, or a draft distribution close to p or far from it).
    With 8 outcomes, the total variation of 20k samples from the truth stays below ~0.02; 0.03 is the bound."""
    torch.manual_seed(0)
    vocab = 8
    p = torch.softmax(torch.randn(2, vocab) * 1.5, dim=-1)
    draft_probs = None
    if proposer == "point-likely":
        token = int(p[0].argmax())
    elif proposer == "point-unlikely":
        token = int(p[0].argmin())
    else:
        q = p[:1] if proposer == "draft-good" else torch.softmax(-3 * p[:1].log(), dim=-1)
        draft_probs = (0.8 * q + 0.2 / vocab) if proposer == "draft-good" else q
    generator = torch.Generator().manual_seed(1)
    firsts = []
    for _ in range(20_000):
        if draft_probs is not None:
            token = int(torch.multinomial(draft_probs[0], 1, generator=generator))
        firsts.append(verify_random(p, [token], generator, draft_probs)[0])
    assert _total_variation(firsts, p[0]) < 0.03


def test_rejection_sampling_bonus_token_follows_the_next_position() -> None:
    torch.manual_seed(1)
    p = torch.softmax(torch.randn(2, 6), dim=-1)
    token = int(p[0].argmax())
    generator = torch.Generator().manual_seed(2)
    seconds = [out[1] for out in (verify_random(p, [token], generator) for _ in range(20_000)) if len(out) == 2]
    assert len(seconds) > 3000
    assert _total_variation(seconds, p[1]) < 0.03


# ------------------------------------------------------------------ the engine, greedy: token-identical


def _engine(loaded_model, tokenizer, **config) -> LLMEngine:  # noqa: ANN001, ANN003
    return LLMEngine.from_loaded(EngineConfig(quantization="none", **config), loaded_model, tokenizer)


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list:
    return run_engine(engine, [{"prompt_token_ids": p} for p in prompts], params)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:  # noqa: ANN001
    plain = [tokenizer.encode(p) for p in PLAIN_PROMPTS]
    chat = [tokenizer.encode_chat(c) for c in CHAT_PROMPTS]
    copy = [tokenizer.encode_chat([{"role": "user", "content": "Repeat the following text exactly, word for word:\n\n"
                                                               + LONG_PARAGRAPH}])]
    return plain + chat + copy


@pytest.fixture(scope="module")
def reference(loaded_model, tokenizer, prompts) -> list:  # noqa: ANN001
    return _run(_engine(loaded_model, tokenizer), prompts, SamplingParams(max_tokens=40, temperature=0))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_greedy_speculation_is_token_identical_alone_and_batched(loaded_model, tokenizer, prompts, reference,  # noqa: ANN001
                                                                 k: int) -> None:
    engine = _engine(loaded_model, tokenizer, speculative_config={"num_speculative_tokens": k})
    params = SamplingParams(max_tokens=40, temperature=0)
    batched = _run(engine, prompts, params)
    assert [o.token_ids for o in batched] == [o.token_ids for o in reference]
    if k in (1, 4):  # alone, too (chat and copy prompts, where proposals are frequent)
        for prompt, expected in list(zip(prompts, reference))[-4:]:
            assert _run(engine, [prompt], params)[0].token_ids == expected.token_ids
    scheduler = engine.core.scheduler
    assert 0 < scheduler.spec.accepted_tokens < scheduler.spec.draft_tokens


def test_speculation_under_chunked_prefill_prefix_hits_and_preemption(loaded_model, tokenizer, prompts,  # noqa: ANN001
                                                                      reference) -> None:
    # a small token budget chunks prompts and squeezes proposals; a small pool preempts; a second pass hits
    engine = _engine(loaded_model, tokenizer, max_num_batched_tokens=48, num_kv_blocks=40, block_size=16,
                     speculative_config={"num_speculative_tokens": 5})
    params = SamplingParams(max_tokens=40, temperature=0)
    fitting = [i for i, p in enumerate(prompts) if len(p) + 40 <= 40 * 16]
    for _ in range(2):
        outs = _run(engine, [prompts[i] for i in fitting], params)
        assert [o.token_ids for o in outs] == [reference[i].token_ids for i in fitting]
    assert engine.core.scheduler.total_preemptions > 0
    assert engine.core.kv.prefix_hits > 0


def test_stops_eos_and_max_tokens_inside_accepted_runs(loaded_model, tokenizer, prompts) -> None:  # noqa: ANN001
    copy = prompts[-1]
    plain = _engine(loaded_model, tokenizer)
    spec = _engine(loaded_model, tokenizer, speculative_config={"num_speculative_tokens": 6})
    full = _run(plain, [copy], SamplingParams(max_tokens=60, temperature=0))[0]
    words = full.text.split()
    cases = [SamplingParams(max_tokens=n, temperature=0) for n in (1, 2, 7, 23)]
    cases += [SamplingParams(max_tokens=60, temperature=0, stop=[words[w]]) for w in (3, 9)]
    cases += [SamplingParams(max_tokens=60, temperature=0, stop=[words[5]], include_stop_str_in_output=True)]
    cases += [SamplingParams(max_tokens=60, temperature=0, stop_token_ids=[full.token_ids[12]])]
    cases += [SamplingParams(max_tokens=60, temperature=0, logprobs=2)]
    for params in cases:
        expected = _run(plain, [copy], params)[0]
        got = _run(spec, [copy], params)[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            expected.token_ids, expected.text, expected.finish_reason, expected.stop_reason), params
        if params.logprobs:
            assert [sorted(e) for e in got.logprobs] == [sorted(e) for e in expected.logprobs]
            for a, b in zip(got.logprobs, expected.logprobs):
                for token in a:
                    assert a[token] == pytest.approx(b[token], abs=1e-4)
    assert spec.core.scheduler.spec.accepted_tokens > 20


def test_seeded_sampling_with_speculation_is_reproducible_and_abort_frees_blocks(loaded_model, tokenizer,  # noqa: ANN001
                                                                                 prompts) -> None:
    engine = _engine(loaded_model, tokenizer, speculative_config={"num_speculative_tokens": 4})
    params = SamplingParams(max_tokens=30, temperature=0.7, seed=11)
    first = _run(engine, [prompts[-1]], params)[0]
    assert _run(engine, [prompts[-1]], params)[0].token_ids == first.token_ids
    request_id = engine.add_request(None, {"prompt_token_ids": prompts[-1]},
                                    SamplingParams(max_tokens=200, temperature=0))
    for _ in range(12):
        engine.step()
    engine.abort_request(request_id)
    assert not engine.has_unfinished_requests()
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks


def test_server_streams_speculated_tokens_like_the_offline_engine(llm, prompts) -> None:  # noqa: ANN001
    """Through HTTP (several tokens per step reach the stream at once): the same text as the engine without
    speculation, stop strings included, and the acceptance counters exported."""
    copy = prompts[-1]
    expected = llm.generate([{"prompt_token_ids": copy}], SamplingParams(max_tokens=60, temperature=0))[0].outputs[0]
    stop = expected.text.split()[8]
    cut = llm.generate([{"prompt_token_ids": copy}], SamplingParams(max_tokens=60, temperature=0, stop=[stop]))
    spec = '{"method": "ngram", "num_speculative_tokens": 4}'
    with live_server("-q", "none", "--speculative-config", spec) as server:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": copy, "max_tokens": 60, "temperature": 0}
        full = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
        assert full["text"] == expected.text
        streamed = ""
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True, "stop": [stop]},
                          timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    streamed += json.loads(line[6:])["choices"][0]["text"]
        assert streamed == cut[0].outputs[0].text
        metrics = httpx.get(server.url + "/metrics").text
        assert (metric_value(metrics, "tokenmill:spec_decode_num_accepted_tokens_total") or 0) > 10


def test_draft_model_int8_drafting_for_float32_target_is_token_identical(loaded_model, tokenizer, prompts,  # noqa: ANN001
                                                                         reference) -> None:
    """The bundled model's int8 copy drafts for the float32 target (a real configuration): outputs identical to
    no speculation, most proposals accepted, and every draft KV block back in its pool at the end."""
    engine = _engine(loaded_model, tokenizer, num_kv_blocks=256, speculative_config={
        "method": "draft_model", "num_speculative_tokens": 3, "quantization": "int8"})
    outs = _run(engine, prompts, SamplingParams(max_tokens=40, temperature=0))
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    scheduler = engine.core.scheduler
    assert scheduler.spec.accepted_tokens > 0.8 * scheduler.spec.draft_tokens > 0
    draft = engine.core.proposer.draft
    assert not draft.states and draft.pool.num_free_blocks == draft.pool.num_blocks
    # sampling with a draft: seeded and reproducible, and an abort mid-run frees the target's blocks
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=5)
    assert _run(engine, [prompts[-1]], params)[0].token_ids == _run(engine, [prompts[-1]], params)[0].token_ids
