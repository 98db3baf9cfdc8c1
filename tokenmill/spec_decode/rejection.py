"""Verification of proposed tokens against the target model's distribution at each proposed position.

Greedy: accept the longest prefix of proposals equal to the target's argmax, then the target's own token.
Random: rejection sampling (Leviathan et al. 2023; Chen et al. 2023): accept proposal d with probability
min(1, p(d) / q(d)); at the first rejection draw from the residual max(p - q, 0), renormalized; when every
proposal is accepted draw a bonus token from the next position's p. The output then follows p exactly, whatever
q is. An n-gram proposer is deterministic: q is a point mass on d, so d is accepted with probability p(d) and
the residual is p without d. Then it is done as one exponential race per position (the sampler's `draw`): the
race's winner is accepted when it is d (probability p(d)) and is otherwise itself the residual draw (a race's
winner, given it is not d, follows p without d). Each emitted token is then the race at its position, whatever
was proposed: with a generator seeded per position, a seeded request samples what it samples without
speculation, and on any engine it moves to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


Generators = torch.Generator | Callable[[int], torch.Generator] | None  # one, or one per position (row)


def verify_random(probs: torch.Tensor, proposed: Sequence[int], generator: Generators,
                  draft_probs: torch.Tensor | None = None) -> list[int]:
    """`probs` [k+1, vocab]: the target's sampling distributions. `draft_probs` [k, vocab] is the proposer's
    distribution (None: a deterministic proposer). Uniforms and draws come from the request's generator, or
    from `generator(j)` for row j."""
    def at(j: int) -> torch.Generator | None:
        return generator(j) if callable(generator) else generator

    emitted: list[int] = []
    if draft_probs is None:
        for j, token in enumerate(proposed):
            winner = draw(probs[j], at(j))
            emitted.append(winner)
            if winner != token:
                return emitted
        emitted.append(draw(probs[len(proposed)], at(len(proposed))))
        return emitted
    for j, token in enumerate(proposed):
        generator_j = at(j)
        p = probs[j]
        q_token = float(draft_probs[j, token])
        accept_probability = min(1.0, float(p[token]) / q_token) if q_token > 0 else 0.0
        uniform = float(torch.rand((), generator=generator_j, device=p.device))
        if uniform < accept_probability:
            emitted.append(token)
            continue
        residual = (p - draft_probs[j]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p equals q (numerically): nothing is left to correct
            residual = p
        emitted.append(draw(residual / residual.sum(), generator_j))
        return emitted
    emitted.append(draw(probs[len(proposed)], at(len(proposed))))
    return emitted
