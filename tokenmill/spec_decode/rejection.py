"""Verification of proposed tokens against the target model's distribution at each proposed position.

Greedy: accept the longest prefix of proposals equal to the target's argmax, then the target's own token.
Random: rejection sampling (Leviathan et al. 2023; Chen et al. 2023): accept proposal d with probability
min(1, p(d) / q(d)); at the first rejection draw from the residual max(p - q, 0), renormalized; when every
proposal is accepted draw a bonus token from the next position's p. The output then follows p exactly, whatever
q is. An n-gram proposer is deterministic: q is a point mass on d, so d is accepted with probability p(d) and
the residual is p without d.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.executor.sampler import draw


def verify_greedy(logits: torch.Tensor, proposed: Sequence[int]) -> list[int]:
    """`logits` [k+1, vocab] (processed) at the k proposed positions and the one after: the emitted tokens."""
    targets = logits.argmax(dim=-1).tolist()
    emitted: list[int] = []
    for target, token in zip(targets, proposed):
        if target != token:
            break
        emitted.append(token)
    emitted.append(targets[len(emitted)])
    return emitted


def verify_random(probs: torch.Tensor, proposed: Sequence[int], generator: torch.Generator | None,
                  draft_probs: torch.Tensor | None = None) -> list[int]:
    """`probs` [k+1, vocab]: the target's sampling distributions. `draft_probs` [k, vocab] is the proposer's
    distribution (None: a deterministic proposer). Uniforms and draws come from the request's generator."""
    emitted: list[int] = []
    for j, token in enumerate(proposed):
        p = probs[j]
        q_token = 1.0 if draft_probs is None else float(draft_probs[j, token])
        accept_probability = min(1.0, float(p[token]) / q_token) if q_token > 0 else 0.0
        uniform = float(torch.rand((), generator=generator, device=p.device))
        if uniform < accept_probability:
            emitted.append(token)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = (p - draft_probs[j]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p equals q (numerically): nothing is left to correct
            residual = p
        emitted.append(draw(residual / residual.sum(), generator))
        return emitted
    emitted.append(draw(probs[len(proposed)], generator))
    return emitted
