"""Paged batches (mixed chunk sizes, decodes of other sequences, shuffled physical blocks) give the same
logits and greedy tokens as each sequence run alone, in every execution mode (float32, int8, bf16)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import DEVICE, LONG_PARAGRAPH
from tokenmill import kernels
from tokenmill.config import EngineConfig
from tokenmill.core.outputs import ScheduledRequest, SchedulerOutput
from tokenmill.executor.model_runner import ModelRunner
from tokenmill.sampling_params import SamplingParams

BLOCK = 16
DECODE_STEPS = 6


# Largest relative logit difference allowed between a sequence alone and batched: float32 only reorders sums;
# the quantized modes may also round an activation to the neighbouring int8/bf16 value.
LOGIT_TOLERANCE = {"none": 1e-4, "int8": 2e-2, "bf16": 5e-2}


@pytest.fixture(scope="module", params=["none", "int8", "bf16"])
def runner(request, loaded_model) -> ModelRunner:  # noqa: ANN001
    if request.param == "int8" and DEVICE != "cpu":
        pytest.skip("int8 is a CPU execution mode")
    if request.param != "none" and not (DEVICE == "cpu" and kernels.native_attention_available()):
        pytest.skip("quantized modes are batch-invariant only with the native CPU attention kernel")
    config = EngineConfig(num_kv_blocks=256, block_size=BLOCK, device=DEVICE, quantization=request.param)
    return ModelRunner(config, loaded_model.config, loaded_model.weights)


class Seq:
    def __init__(self, name: str, prompt: list[int], chunk: int, table: list[int]) -> None:
        self.name, self.tokens, self.chunk, self.table = name, list(prompt), chunk, table
        self.prompt_len = len(prompt)
        self.computed = 0
        self.logits: list[torch.Tensor] = []

    @property
    def done(self) -> bool:
        return len(self.tokens) - self.prompt_len >= DECODE_STEPS

    def next_request(self) -> ScheduledRequest:
        n = min(self.chunk, len(self.tokens) - self.computed)
        ids = self.tokens[self.computed:self.computed + n]
        req = ScheduledRequest(self.name, ids, self.computed, self.table, self.computed + n == len(self.tokens),
                               SamplingParams(temperature=0), self.tokens[:self.prompt_len], [])
        self.computed += n
        return req


def run(runner: ModelRunner, seqs: list[Seq], rng: random.Random | None = None) -> None:
    while not all(s.done for s in seqs):
        active = [s for s in seqs if not s.done]
        if rng:
            rng.shuffle(active)
        scheduled = [s.next_request() for s in active]
        sampled, logits = runner.compute_logits(SchedulerOutput(scheduled))
        if logits is None:
            continue
        by_name = {s.name: s for s in seqs}
        for req, row in zip(sampled, logits):
            seq = by_name[req.request_id]
            seq.logits.append(row.cpu())
            seq.tokens.append(int(row.argmax()))


def test_mixed_paged_batches_match_sequences_run_alone(runner: ModelRunner, tokenizer) -> None:  # noqa: ANN001
    texts = ["Hello", "The capital of France is", LONG_PARAGRAPH, LONG_PARAGRAPH * 3 + " Therefore",
             "def add(a, b):\n    return", "Once upon a time, there was a robot who"]
    prompts = [tokenizer.encode(t) for t in texts]
    chunks = [1, 7, 64, 64, 7, 1]

    alone = []
    for i, prompt in enumerate(prompts):
        seq = Seq(f"s{i}", prompt, chunk=10_000, table=list(range(40)))
        run(runner, [seq])
        alone.append(seq)

    rng = random.Random(0)
    physical = list(range(256))
    rng.shuffle(physical)  # blocks of a sequence are neither contiguous nor ordered
    batched = [Seq(f"s{i}", p, chunk=c, table=physical[i * 40:(i + 1) * 40])
               for i, (p, c) in enumerate(zip(prompts, chunks))]
    run(runner, batched, rng)

    for a, b in zip(alone, batched):
        assert a.tokens == b.tokens, (a.name, a.tokens[a.prompt_len:], b.tokens[b.prompt_len:])
        assert len(a.logits) == len(b.logits) == DECODE_STEPS
        for la, lb in zip(a.logits, b.logits):
            rel = ((la - lb).abs().max() / la.abs().max()).item()
            assert rel < LOGIT_TOLERANCE[runner.quantization], (a.name, rel)


def test_mixed_steps_really_mix_prefill_and_decode(runner: ModelRunner, tokenizer) -> None:  # noqa: ANN001
    """Guard on the test above: its steps must contain prompt chunks next to decodes of other sequences."""
    long = Seq("long", tokenizer.encode(LONG_PARAGRAPH * 3), chunk=7, table=list(range(0, 40)))
    short = Seq("short", tokenizer.encode("Hi there"), chunk=64, table=list(range(40, 80)))
    first = [long.next_request(), short.next_request()]
    runner.compute_logits(SchedulerOutput(first))
    short.tokens.append(0)
    second = [long.next_request(), short.next_request()]
    assert second[0].num_tokens == 7 and not second[0].sample
    assert second[1].num_tokens == 1 and second[1].sample
