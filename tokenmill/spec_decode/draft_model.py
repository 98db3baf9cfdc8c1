"""Draft-model proposer: a smaller (or cheaper, e.g. int8) model with the target's tokenizer guesses the next k
tokens greedily, one batched forward pass per guessed token.

The draft keeps its own paged KV cache under the same discipline as the target: blocks from its own pool, a
block table per request, and a count of the tokens whose KV it holds. Each step it catches up on the tokens it
has not seen (the prompt the first time, then the accepted proposals and the target's token), which also
overwrites the KV of proposals the target rejected. Its proposals are deterministic (argmax), so verification
treats them as point masses, exactly as n-gram proposals: the target's distribution is kept either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmill.config import EngineConfig
from tokenmill.core.block_pool import BlockPool
from tokenmill.core.kv_cache_manager import cdiv
from tokenmill.core.outputs import ScheduledRequest, SchedulerOutput
from tokenmill.executor.model_runner import ModelRunner
from tokenmill.model.loader import load_model
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.config import SpeculativeConfig

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


@dataclass
class _DraftState:
    fed: list[int] = field(default_factory=list)  # tokens whose KV the draft computed, in position order
    blocks: list[int] = field(default_factory=list)


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, target: EngineConfig, num_kv_blocks: int) -> None:
        self.config = config
        loaded = load_model(config.model)
        draft_config = EngineConfig(model=config.model, device=target.device, quantization=config.quantization,
                                    block_size=target.block_size, num_kv_blocks=num_kv_blocks)
        self.runner = ModelRunner(draft_config, loaded.config, loaded.weights)
        self.block_size = target.block_size
        self.pool = BlockPool(num_kv_blocks, enable_caching=False)
        self.states: dict[str, _DraftState] = {}

    def _release(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.pool.release(self.pool.blocks[b] for b in state.blocks)

    def _reserve(self, state: _DraftState, num_positions: int) -> bool:
        missing = cdiv(num_positions, self.block_size) - len(state.blocks)
        if missing > self.pool.num_free_blocks:
            return False
        state.blocks += [b.block_id for b in self.pool.allocate(max(0, missing))]
        return True

    def propose(self, running: Sequence[Request], eligible: Sequence[Request], ks: Sequence[int]) -> None:
        """Set `spec_token_ids` (up to k each) of the eligible requests; forget requests that left `running`."""
        alive = {r.request_id for r in running}
        for request_id in [rid for rid in self.states if rid not in alive]:
            self._release(request_id)
        rows: list[tuple[Request, _DraftState, int]] = []
        for request, k in zip(eligible, ks):
            state = self.states.setdefault(request.request_id, _DraftState())
            tokens = request.all_token_ids
            valid = 0  # the fed tokens still equal to the sequence (rejected proposals drop out here)
            limit = min(len(state.fed), len(tokens) - 1)
            while valid < limit and state.fed[valid] == tokens[valid]:
                valid += 1
            del state.fed[valid:]
            if self._reserve(state, len(tokens) + k - 1):
                rows.append((request, state, k))
        if not rows:
            return
        # pass 1: catch up on every unseen token and guess the first; then one token per pass
        plan = [ScheduledRequest(r.request_id, r.all_token_ids[len(s.fed):], len(s.fed), s.blocks, True, _GREEDY,
                                 r.prompt_token_ids, r.output_token_ids) for r, s, _ in rows]
        for r, s, _ in rows:
            s.fed = list(r.all_token_ids)
        guesses = self.runner.execute(SchedulerOutput(plan)).sampled_token_ids
        for r, _, _ in rows:
            r.spec_token_ids = [guesses[r.request_id]]
        for step in range(1, max(k for _, _, k in rows)):
            active = [(r, s) for r, s, k in rows if k > step]
            plan = [ScheduledRequest(r.request_id, [r.spec_token_ids[-1]], len(s.fed), s.blocks, True, _GREEDY,
                                     r.prompt_token_ids, r.output_token_ids) for r, s in active]
            for r, s in active:
                s.fed.append(r.spec_token_ids[-1])
            guesses = self.runner.execute(SchedulerOutput(plan)).sampled_token_ids
            for r, _ in active:
                r.spec_token_ids.append(guesses[r.request_id])
