"""Requests whose prompt prefix the KV tiers under the pool hold (kv_offload/): admitted with blocks for that
prefix, they wait here while it is read back in the background (as a disaggregated request waits for its remote
KV); steps go on meanwhile. Then they run from the first token the tiers did not have."""

from __future__ import annotations

from typing import Protocol

from tokenmill.core.kv_cache_manager import KVCacheManager, PrefixHit
from tokenmill.request import Request

# Prefill cost before any prompt step was timed: 1 ms a token (a fast CPU's prefill); measured steps replace it.
DEFAULT_PREFILL_S_PER_TOKEN = 1e-3


class TierIndex(Protocol):
    """The tiers as the scheduler sees them (kv_offload/store.py: KVTierStore)."""

    def count_hits(self, keys: list[int], token_ids: list[tuple[int, ...]]) -> int: ...

    def load_seconds(self, keys: list[int], block_bytes: int) -> float: ...

    def start_load(self, request_id: str, keys: list[int], token_ids: list[tuple[int, ...]],
                   block_ids: list[int]) -> None: ...

    def poll(self) -> list[tuple[str, int]]: ...


class TierLoads:
    def __init__(self, kv: KVCacheManager, tiers: TierIndex, block_bytes: int) -> None:
        self.kv = kv
        self.tiers = tiers
        self.block_bytes = block_bytes
        self.prefill_s_per_token = DEFAULT_PREFILL_S_PER_TOKEN
        self.loading: dict[str, tuple[Request, PrefixHit]] = {}
        self.skipped_by_cost = 0  # tier hits recomputed instead: reading them back would have been slower

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step that ran `tokens` prompt tokens in `seconds`: the recompute side of the cost rule."""
        if tokens >= 64 and seconds > 0:
            self.prefill_s_per_token = 0.8 * self.prefill_s_per_token + 0.2 * seconds / tokens

    def admit(self, request: Request, hit: PrefixHit, whole_prompt: bool = False) -> bool | None:
        """Start loading the blocks after the pool's hit that the tiers hold. None: nothing worth loading
        (admit it as usual); False: no room yet (it waits); True: loading. `whole_prompt`: blocks for the whole
        prompt are taken now (a decode engine's request, whose remaining KV a transfer fills next)."""
        if request.needs_prompt_logprobs:  # a loaded block has no logits (as for pool hits)
            return None
        block_size = self.kv.block_size
        first = len(hit.blocks)
        last = (request.num_tokens - 1) // block_size  # at least one token is always left to compute
        keys = request.block_hashes[first:last]
        tokens = [tuple(request.all_token_ids[i * block_size:(i + 1) * block_size]) for i in range(first, last)]
        count = self.tiers.count_hits(keys, tokens)
        if not count:
            return None
        keys, tokens = keys[:count], tokens[:count]
        if self.tiers.load_seconds(keys, self.block_bytes) >= count * block_size * self.prefill_s_per_token:
            self.skipped_by_cost += 1
            return None
        room = request.num_tokens - hit.num_tokens if whole_prompt else count * block_size
        if self.kv.allocate_slots(request, room, hit, cache=False) is None:
            return False
        block_ids = self.kv.block_table(request.request_id)[first:first + count]
        self.loading[request.request_id] = (request, hit)
        self.tiers.start_load(request.request_id, keys, tokens, block_ids)
        return True

    def finished(self) -> list[tuple[Request, PrefixHit]]:
        """Loads done since the last call: each request with its prefix (pool hit + loaded blocks) computed.
        Requests aborted meanwhile just free their blocks."""
        ready = []
        for request_id, loaded in self.tiers.poll():
            request, hit = self.loading.pop(request_id)
            if request.is_finished:
                self.kv.free(request_id)
                continue
            num_blocks = len(hit.blocks) + loaded
            num_tokens = num_blocks * self.kv.block_size
            self.kv.cache_full_blocks(request, num_tokens)
            ready.append((request, PrefixHit(self.kv.req_blocks[request_id][:num_blocks], num_tokens)))
        return ready
