"""Beam search (vLLM's LLM.beam_search and the completions API's use_beam_search) against transformers' beam search
on the bundled model in float32: the same hypotheses in the same order with the same scores, with and without a
length penalty, on prompts whose answers end with the end-of-sequence token and on ones cut at max_tokens."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch

from tokenmill import LLM, BeamSearchParams, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


CHATS = [[{"role": "user", "content": "What is the capital of Japan?"}],
         [{"role": "user", "content": "What is 12 * 12?"}]]


def _transformers_beams(hf_model: Any, prompt: list[int], params: BeamSearchParams,
                        eos: list[int]) -> tuple[list[list[int]], list[float]]:
    out = hf_model.generate(torch.tensor([prompt]), num_beams=params.beam_width,
                            num_return_sequences=params.beam_width, do_sample=False, early_stopping=True,
                            max_new_tokens=params.max_tokens, length_penalty=params.length_penalty,
                            eos_token_id=eos, pad_token_id=eos[0], return_dict_in_generate=True, output_scores=True)
    beams = []
    for sequence in out.sequences.tolist():
        generated = sequence[len(prompt):]
        ends = [i for i, t in enumerate(generated) if t in eos]
        beams.append(generated[:ends[0] + 1] if ends else generated)
    return beams, out.sequences_scores.tolist()


@pytest.mark.parametrize("params", [BeamSearchParams(beam_width=3, max_tokens=16),
                                    BeamSearchParams(beam_width=2, max_tokens=40, length_penalty=0.6)],
                         ids=["width3", "width2-penalty0.6"])
def test_beam_search_matches_transformers(llm: LLM, hf_model: Any, params: BeamSearchParams) -> None:
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS] + [llm.tokenizer.encode_chat(c) for c in CHATS]
    eos = list(llm.engine.eos_token_ids)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    ended = 0
    for prompt, output in zip(prompts, outputs):
        beams, scores = _transformers_beams(hf_model, prompt, params, eos)
        assert [s.tokens for s in output.sequences] == beams
        assert [s.score(params.length_penalty) for s in output.sequences] == pytest.approx(scores, abs=1e-4)
        ended += sum(s.finished for s in output.sequences)
        assert all(s.text == llm.tokenizer.decode(s.tokens) for s in output.sequences)
    assert ended  # some hypotheses ended with end-of-sequence, the rest at max_tokens
    # the blocks the search cached are sound: greedy answers read them and still equal transformers'
    hits = llm.engine.core.kv.prefix_hits
    greedy = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8))
    assert llm.engine.core.kv.prefix_hits > hits
    for prompt, output in zip(prompts, greedy):
        expected = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8, pad_token_id=eos[0])
        tokens = list(output.outputs[0].token_ids)
        assert tokens == expected[0, len(prompt):].tolist()[:len(tokens)]


def test_completions_beam_search_over_http(base_url: str, llm: LLM) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPTS[0], "max_tokens": 12, "use_beam_search": True,
            "n": 2, "beam_width": 3}
    reply = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    # the server's int8 weights are not the float32 reference: the shape, not the tokens, is checked here
    assert [c["index"] for c in choices] == [0, 1] and all(c["text"] for c in choices)
    assert choices[0]["text"] != choices[1]["text"] and {c["finish_reason"] for c in choices} <= {"stop", "length"}
    usage = reply.json()["usage"]
    assert usage["prompt_tokens"] == len(llm.tokenizer.encode(PROMPTS[0]))
    assert 2 <= usage["completion_tokens"] <= 24 and usage["total_tokens"] == usage["prompt_tokens"] + usage[
        "completion_tokens"]
    for bad, message in [({"beam_width": 0}, "beam_width"), ({"stream": True}, "streaming"),
                         ({"n": 4}, "cannot exceed"), ({"best_of": 1}, "must be at least n"),
                         ({"use_beam_search": False}, "needs use_beam_search"), ({"logprobs": 2}, "no logprobs")]:
        reply = httpx.post(base_url + "/v1/completions", json={**body, **bad}, timeout=30)
        assert reply.status_code == 400 and message in reply.text, (bad, reply.text)


def test_best_of_returns_the_most_likely_samples(base_url: str) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 1.0, "seed": 7,
            "logprobs": 0}
    drawn = httpx.post(base_url + "/v1/completions", json={**body, "n": 5}, timeout=120).json()["choices"]
    best = httpx.post(base_url + "/v1/completions", json={**body, "n": 2, "best_of": 5}, timeout=120).json()
    # the same seeds draw the same five samples; best_of keeps the two of highest cumulative logprob, in order
    total = {c["text"]: sum(c["logprobs"]["token_logprobs"]) for c in drawn}
    expected = sorted(total, key=lambda text: -total[text])[:2]
    assert [c["text"] for c in best["choices"]] == expected and [c["index"] for c in best["choices"]] == [0, 1]
    assert best["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in drawn)
    reply = httpx.post(base_url + "/v1/completions", json={**body, "best_of": 3, "stream": True}, timeout=30)
    assert reply.status_code == 400 and "best_of cannot be used with stream" in reply.text


def test_beams_share_their_blocks_through_the_prefix_cache(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step after the first computes at most each beam's last partial block (plus the token whose logits it
    needs): the prompt's blocks, and each beam's history, come from the pool."""
    seen: list[tuple[int, int]] = []  # (tokens in the step request, of them read from the cache)
    generate = llm.generate

    def recording(prompts: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        outputs = generate(prompts, params, *args, **kwargs)
        seen.extend((len(o.prompt_token_ids), o.num_cached_tokens) for o in outputs)
        return outputs

    monkeypatch.setattr(llm, "generate", recording)
    prompt = llm.tokenizer.encode("Tell me a story about a lighthouse keeper. " * 12)
    llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=20, ignore_eos=True))
    block = llm.engine.config.block_size
    assert len(seen) == 1 + 3 * 19  # one request for the prompt, then one per beam and step
    for length, cached in seen[1:]:
        assert cached >= (length - 1) // block * block, (length, cached)
