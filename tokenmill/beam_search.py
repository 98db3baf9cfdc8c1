"""Beam search (vLLM's `LLM.beam_search` and the completions API's `use_beam_search`), run over the engine one
token at a time: each step asks for the next token of every live beam with its 2 x beam_width most likely
alternatives, and keeps the beam_width best continuations by cumulative log-probability (transformers' rule: an
end-of-sequence among the beam_width best candidates finishes a hypothesis; the search stops when beam_width have
finished, or at max_tokens). Hypotheses are ranked by cumulative logprob / generated length ** length_penalty.

The beams share their blocks through prefix caching, as in vLLM: a beam's step request is its prompt and history,
whose full blocks the pool already holds from the step before (the prompt's, written once, are read by every
beam), so a step computes only each beam's last partial block."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from tokenmill.sampling_params import MAX_LOGPROBS


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(f"beam_width must be in [1, {MAX_LOGPROBS // 2}], got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1 with beam search, got {self.max_tokens}")


@dataclass
class BeamSearchSequence:
    tokens: list[int] = field(default_factory=list)  # generated tokens (an end-of-sequence token included)
    cum_logprob: float = 0.0
    finished: bool = False  # ended by end-of-sequence (else by max_tokens)
    text: str = ""

    def score(self, length_penalty: float) -> float:
        return self.cum_logprob / (max(len(self.tokens), 1) ** length_penalty)


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


class BeamSearch:
    """One prompt's search, a step at a time: `sequences()` are the token sequences whose next token the engine
    must give (with `2 * beam_width` alternatives each), `advance` takes those alternatives."""

    def __init__(self, prompt: Sequence[int], params: BeamSearchParams, eos_token_ids: Collection[int]) -> None:
        self.prompt = list(prompt)
        self.params = params
        self.eos_token_ids = set(eos_token_ids)
        self.running = [BeamSearchSequence()]
        self.finished: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.running

    @property
    def alternatives(self) -> int:
        return 2 * self.params.beam_width

    def sequences(self) -> list[list[int]]:
        return [[*self.prompt, *beam.tokens] for beam in self.running]

    def advance(self, alternatives: Sequence[dict[int, float]]) -> None:
        """Each running beam's next-token logprobs (most likely first or not) -> the next beams."""
        width = self.params.beam_width
        candidates = sorted(((beam.cum_logprob + logprob, i, token) for i, (beam, top) in
                             enumerate(zip(self.running, alternatives)) for token, logprob in top.items()),
                            key=lambda c: -c[0])[:2 * width]
        kept: list[BeamSearchSequence] = []
        for rank, (cum_logprob, i, token) in enumerate(candidates):
            tokens = [*self.running[i].tokens, token]
            if token in self.eos_token_ids and not self.params.ignore_eos:
                if rank < width:
                    self.finished.append(BeamSearchSequence(tokens, cum_logprob, finished=True))
                continue
            kept.append(BeamSearchSequence(tokens, cum_logprob))
            if len(kept) == width:
                break
        self.steps += 1
        if len(self.finished) >= width:
            kept = []  # done: hypotheses still running are not candidates (transformers' early stopping)
        self.running = kept if self.steps < self.params.max_tokens else []
        if self.steps >= self.params.max_tokens:
            self.finished += kept

    def result(self) -> list[BeamSearchSequence]:
        """The beam_width best hypotheses, best first."""
        ranked = sorted(self.finished, key=lambda s: s.score(self.params.length_penalty), reverse=True)
        return ranked[:self.params.beam_width]


# (token sequences, how many alternatives) -> for each sequence, its next token's most likely ids -> logprobs
NextTokens = Callable[[list[list[int]], int], list[dict[int, float]]]


def next_step(searches: Sequence[BeamSearch]) -> tuple[list[BeamSearch], list[list[int]], int]:
    """The live searches, every live beam's token sequence (batched into one engine step) and how many
    alternatives to ask for."""
    live = [search for search in searches if not search.done]
    sequences = [seq for search in live for seq in search.sequences()]
    return live, sequences, max((search.alternatives for search in live), default=0)


def advance_all(live: Sequence[BeamSearch], alternatives: Sequence[dict[int, float]]) -> None:
    """Hand each live search its beams' alternatives, in next_step's order."""
    at = 0
    for search in live:
        count = len(search.running)
        search.advance(alternatives[at:at + count])
        at += count


def run_beam_searches(searches: Sequence[BeamSearch], next_tokens: NextTokens) -> None:
    """Step every search to its end, the live beams of all of them batched into one engine call per step."""
    while True:
        live, sequences, count = next_step(searches)
        if not live:
            return
        advance_all(live, next_tokens(sequences, count))
