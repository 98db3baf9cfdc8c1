"""lm-evaluation-harness against a live server (`local-completions`, the server's own tokenizer through
/tokenize), on the small tasks in tests/data/lm_eval, checked against transformers' float32 loglikelihoods
and greedy generations on the same weights; and `echo` with prompt logprobs through the official client."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.server_utils import live_server

MODEL = "SmolLM2-135M-Instruct"
ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "tests" / "data" / "lm_eval"


@pytest.fixture(scope="module")
def exact_server() -> Any:
    with live_server("--quantization", "none", "--enable-tokenizer-info-endpoint") as server:
        yield server.url


@pytest.fixture(scope="module")
def harness_results(exact_server: str) -> dict[str, Any]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    cwd = os.getcwd()
    os.chdir(ROOT)  # the task files name their data relative to the repository root
    try:
        return simple_evaluate(
            model="local-completions",
            model_args={"base_url": exact_server + "/v1/completions", "model": MODEL, "tokenizer_backend": "remote",
                        "tokenized_requests": True, "max_retries": 1},
            tasks=["tokenmill_mc", "tokenmill_gen"], batch_size=4, log_samples=True,
            task_manager=TaskManager(include_path=str(TASKS)),
        )
    finally:
        os.chdir(cwd)


def encode_pair(hf_tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:  # noqa: ANN001
    """lm-eval's split of a request into context and continuation tokens, with transformers' tokenizer."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = hf_tokenizer(context + continuation, add_special_tokens=False).input_ids
    context_ids = hf_tokenizer(context, add_special_tokens=False).input_ids
    return context_ids, whole[len(context_ids):]


def request_args(sample: dict[str, Any]) -> list[tuple[str, ...]]:
    """A sample's requests' arguments (a list of tuples in memory, a dict once written out)."""
    arguments = sample["arguments"]
    if isinstance(arguments, dict):
        return [tuple(a.values()) for a in arguments.values()]
    return [tuple(a) for a in arguments]


def test_loglikelihood_task_agrees_with_transformers(harness_results, hf_model, hf_tokenizer) -> None:  # noqa: ANN001
    samples = harness_results["samples"]["tokenmill_mc"]
    assert len(samples) == 20
    correct = 0
    for sample in samples:
        scores = []
        for index, (args, response) in enumerate(zip(request_args(sample), sample["filtered_resps"])):
            context_ids, continuation_ids = encode_pair(hf_tokenizer, args[0], args[1])
            with torch.no_grad():
                logits = hf_model(torch.tensor([context_ids + continuation_ids])).logits[0].float()
            logprobs = logits.log_softmax(-1)
            expected = sum(float(logprobs[len(context_ids) - 1 + i, t]) for i, t in enumerate(continuation_ids))
            greedy = all(int(logprobs[len(context_ids) - 1 + i].argmax()) == t for i, t in enumerate(continuation_ids))
            served = float(response[0])
            assert served == pytest.approx(expected, abs=1e-3), (sample["doc_id"], index)
            assert (str(response[1]) == "True") == greedy
            scores.append(expected)
        correct += max(range(len(scores)), key=scores.__getitem__) == sample["doc"]["answer"]
    accuracy = harness_results["results"]["tokenmill_mc"]["acc,none"]
    assert accuracy == pytest.approx(correct / len(samples))


def test_generate_until_task_agrees_with_transformers(harness_results, hf_model, hf_tokenizer) -> None:  # noqa: ANN001
    samples = harness_results["samples"]["tokenmill_gen"]
    assert len(samples) == 6
    for sample in samples:
        context = request_args(sample)[0][0]
        ids = hf_tokenizer(context, add_special_tokens=False).input_ids
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
        text = hf_tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        for stop in ("\n", "Q:"):
            text = text.split(stop)[0]
        assert sample["filtered_resps"][0] == text


def test_tokenize_round_trip_and_chat(exact_server: str, hf_tokenizer) -> None:  # noqa: ANN001
    text = "Tokenize me: naïve café, 東京 🚀"
    body = httpx.post(exact_server + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert body["tokens"] == hf_tokenizer(text).input_ids and body["count"] == len(body["tokens"])
    assert body["max_model_len"] > 0 and len(body["token_strs"]) == body["count"]
    back = httpx.post(exact_server + "/detokenize", json={"tokens": body["tokens"]}).json()
    assert back["prompt"] == text
    messages = [{"role": "user", "content": "Hello!"}]
    chat = httpx.post(exact_server + "/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                              return_dict=False)
    info = httpx.get(exact_server + "/tokenizer_info").json()
    assert info["eos_token"] == hf_tokenizer.eos_token and info["chat_template"]


def test_echo_scores_token_prompts_with_n_and_max_tokens_zero(exact_server: str, hf_model, hf_tokenizer) -> None:  # noqa: ANN001
    client = openai.OpenAI(base_url=exact_server + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = [hf_tokenizer("The capital of France is", add_special_tokens=False).input_ids,
               hf_tokenizer("def fibonacci(n):", add_special_tokens=False).input_ids]
    response = client.completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=2, n=2,
                                         temperature=0)
    assert len(response.choices) == 4 and response.usage.completion_tokens == 0
    for choice in response.choices:
        ids = prompts[choice.index // 2]
        assert choice.text == hf_tokenizer.decode(ids) and choice.finish_reason == "length"
        logprobs = choice.logprobs
        assert logprobs is not None and len(logprobs.tokens) == len(ids)
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        expected = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        for i in range(1, len(ids)):
            assert logprobs.token_logprobs[i] == pytest.approx(float(expected[i - 1, ids[i]]), abs=1e-3)
            assert len(logprobs.top_logprobs[i]) == 2
            assert max(logprobs.top_logprobs[i].values()) == pytest.approx(float(expected[i - 1].max()), abs=1e-3)
        assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


def test_echo_streams_the_prompt_first_and_vllm_prompt_logprobs(exact_server: str) -> None:
    client = openai.OpenAI(base_url=exact_server + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = "Once upon a time,"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, echo=True, temperature=0)
    stream = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, echo=True, temperature=0,
                                            stream=True))
    streamed = "".join(c.choices[0].text for c in stream if c.choices)
    assert streamed == full.choices[0].text and streamed.startswith(prompt) and len(streamed) > len(prompt)
    body = httpx.post(exact_server + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 1}).json()
    scored = body["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == body["usage"]["prompt_tokens"]
    assert all(math.isfinite(v["logprob"]) and v["logprob"] <= 0 for entry in scored[1:] for v in entry.values())
