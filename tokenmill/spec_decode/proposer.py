"""Chooses, after each step, the tokens each running request proposes for the next one: which requests
speculate and how many tokens (the adaptive part), then the n-gram lookup or the draft model fills them in."""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.config import EngineConfig
from tokenmill.request import Request
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.ngram import propose_ngram

# A request whose proposals stop paying pauses for this many steps, doubling on each relapse, up to the max.
FIRST_PAUSE_STEPS = 8
MAX_PAUSE_STEPS = 256
# The acceptance a request must keep rises from `min_acceptance_rate` alone to 1.0 at this many running
# requests. Alone, a step verifying 4 proposals costs ~1.8x a plain one here (the weights are streamed once
# either way), so ~20% acceptance pays; in a full batch the step is compute-bound and every proposed token
# costs a row of compute (benchmarks/bench_spec_decode.py: at 32 streams, 47% acceptance lost 5%, 72% gained).
FULL_BATCH = 64


class Proposer:
    def __init__(self, config: SpeculativeConfig, engine: EngineConfig, num_kv_blocks: int) -> None:
        self.config = config
        self.draft = None
        if config.method == "draft_model":
            from tokenmill.spec_decode.draft_model import DraftModelProposer

            self.draft = DraftModelProposer(config, engine, num_kv_blocks)

    def propose(self, running: Sequence[Request]) -> None:
        """Set `spec_token_ids` of every running request for the next step (empty when it should not speculate)."""
        config = self.config
        crowded = config.disable_by_batch_size is not None and len(running) >= config.disable_by_batch_size
        fullness = min(1.0, (len(running) - 1) / FULL_BATCH)
        bar = config.min_acceptance_rate + (1.0 - config.min_acceptance_rate) * fullness
        eligible: list[Request] = []
        ks: list[int] = []
        for request in running:
            request.spec_token_ids = []
            if crowded or request.num_computed_tokens != request.num_tokens - 1:  # prefilling, or crowded
                continue
            if request.spec_pause_steps:
                request.spec_pause_steps -= 1
                continue
            if request.spec_acceptance < bar:
                request.spec_pause_length = min(MAX_PAUSE_STEPS, 2 * request.spec_pause_length or FIRST_PAUSE_STEPS)
                request.spec_pause_steps = request.spec_pause_length
                request.spec_acceptance = bar  # one more poor proposal pauses it again
                continue
            # a step emits accepted proposals + 1 token: never propose past the request's length limit
            k = min(config.num_speculative_tokens, request.max_total_tokens - request.num_tokens - 1)
            if k > 0:
                eligible.append(request)
                ks.append(k)
        if self.draft is not None:
            self.draft.propose(running, eligible, ks)
            return
        for request, k in zip(eligible, ks):
            request.spec_token_ids = propose_ngram(request.all_token_ids, k, config.prompt_lookup_min,
                                                   config.prompt_lookup_max)
