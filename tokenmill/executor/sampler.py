"""Batched sampling with per-request parameters.

Order of operations (as in vLLM): logit bias, penalties, temperature, top-k, top-p, min-p, then a
draw. Greedy rows (temperature 0) take the argmax after penalties. Random rows draw with the exponential race
(argmax of p / E with E ~ Exp(1)), the noise coming from a generator owned by the request, so a request's
tokens depend on its seed only, never on what else is in the batch. Logprobs are those of the model's raw
distribution (before penalties and temperature), as vLLM reports by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None  # None for greedy rows
    banned_token_ids: Sequence[int] = ()  # masked to -inf (min_tokens not reached yet)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens (transformers' rule: divide positive logits, multiply
    negative ones); presence and frequency penalties over output tokens (OpenAI's rule:
    logit -= frequency * count + presence * (count > 0))."""
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(list(row.prompt_token_ids) + list(row.output_token_ids), dtype=torch.long,
                                device=logits.device).unique()
            scores = logits[i, seen]
            logits[i, seen] = torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
            counts = torch.bincount(torch.tensor(list(row.output_token_ids), dtype=torch.long,
                                                 device=logits.device), minlength=vocab)[:vocab].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    for i, row in enumerate(rows):
        if row.params.logit_bias:
            ids = torch.tensor(list(row.params.logit_bias), dtype=torch.long, device=logits.device)
            bias = torch.tensor(list(row.params.logit_bias.values()), dtype=logits.dtype, device=logits.device)
            logits[i, ids] += bias
    return logits


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k / top-p / min-p exclude; rows are [N, V], parameters [N] (k=0: off)."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    remove = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # drop a token when the mass strictly above it already reaches top_p (the top token always stays)
    mass_above = probs.cumsum(dim=-1) - probs
    remove |= mass_above >= top_p[:, None]
    remove[:, 0] = False
    # min-p: below min_p times the top token's probability
    remove |= probs < (min_p * probs[:, 0])[:, None]
    remove[:, 0] = False
    return logits.scatter(-1, order, sorted_logits.masked_fill(remove, float("-inf")))


def random_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution a random row draws from: temperature, then top-k / top-p / min-p, then softmax."""
    device = logits.device
    sub = logits / torch.tensor([p.temperature for p in params], device=device)[:, None]
    if any(p.top_k or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        sub = filter_logits(
            sub,
            torch.tensor([p.top_k for p in params], device=device),
            torch.tensor([p.top_p for p in params], device=device, dtype=sub.dtype),
            torch.tensor([p.min_p for p in params], device=device, dtype=sub.dtype),
        )
    return sub.softmax(dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from one row of probabilities: the exponential race, noise from the request's generator."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def logprob_entries(raw_logprobs: torch.Tensor, token_ids: Sequence[int], top_n: int) -> list[dict[int, float]]:
    """Per row of a raw log-softmax [rows, vocab]: its token's logprob and the top-N alternatives."""
    index = torch.tensor(list(token_ids), dtype=torch.long, device=raw_logprobs.device)
    entries = [{t: v} for t, v in zip(token_ids, raw_logprobs.gather(1, index[:, None])[:, 0].tolist())]
    if top_n:
        values, ids = raw_logprobs.topk(top_n, dim=-1)
        for entry, row_values, row_ids in zip(entries, values.tolist(), ids.tolist()):
            for v, t in zip(row_values, row_ids):
                entry.setdefault(t, v)
    return entries


def logprob_entry(raw_logprobs: torch.Tensor, token_id: int, top_n: int) -> dict[int, float]:
    """The chosen token's logprob and the top-N alternatives (one row of the raw log-softmax)."""
    return logprob_entries(raw_logprobs[None], [token_id], top_n)[0]


class Sampler:
    @staticmethod
    def process(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Logit bias, penalties and banned tokens: the logits every decision (greedy or random) starts from."""
        logits = logits.float()
        if any(r.params.logit_bias for r in rows):
            logits = apply_logit_bias(logits.clone(), rows)
        if any(r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty
               for r in rows):
            logits = apply_penalties(logits.clone(), rows)
        banned = [i for i, row in enumerate(rows) if row.banned_token_ids]
        if banned:
            logits = logits.clone()
            for i in banned:
                logits[i, list(rows[i].banned_token_ids)] = float("-inf")
        return logits

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in rows):
            raw_logprobs = logits.float().log_softmax(dim=-1)
        logits = self.process(logits, rows)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            probs = random_probs(logits[idx], [rows[i].params for i in random_rows])
            noise = torch.empty_like(probs)
            for j, i in enumerate(random_rows):
                noise[j].exponential_(generator=rows[i].generator)
            tokens[idx] = (probs / noise).argmax(dim=-1)

        token_list = tokens.tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(rows)
        if raw_logprobs is not None:
            for i, row in enumerate(rows):
                if row.params.logprobs is not None:
                    logprobs[i] = logprob_entry(raw_logprobs[i], token_list[i], row.params.logprobs)
        return SamplerOutput(token_list, logprobs)
