"""A consumer engine's requests whose prompt KV another engine computed (prefill/decode disaggregation): admitted
with their blocks allocated, they wait here while the KV arrives in the background; steps go on meanwhile."""

from __future__ import annotations

from typing import Protocol

from tokenmill.core.kv_cache_manager import KVCacheManager, PrefixHit
from tokenmill.request import Request


class KVLoader(Protocol):
    """Fetches a request's remote KV into its blocks in the background (the engine core's, disaggregated)."""

    def start(self, request: Request, first_block: int, block_ids: list[int]) -> None: ...

    def skip(self, request: Request) -> None:
        """Nothing to fetch (the prefix cache had it): reported done at the next poll."""

    def poll(self) -> list[tuple[str, str | None, int, float]]:
        """Loads done since the last poll: (request id, error or None, bytes, seconds)."""
        ...


class RemoteKVLoads:
    def __init__(self, kv: KVCacheManager, loader: KVLoader) -> None:
        self.kv = kv
        self.loader = loader
        self.loading: dict[str, tuple[Request, PrefixHit]] = {}  # admitted, blocks held, KV still arriving
        self.failures: list[tuple[str, str]] = []  # (request, error) not yet reported
        self.loaded: list[tuple[str, int, float]] = []  # (request, bytes, seconds) not yet reported

    def admit(self, request: Request, hit: PrefixHit) -> bool:
        """Allocate the request's blocks and start loading the KV of the prompt positions the prefix cache
        lacks. False when it must wait (no room yet: nothing half-transferred)."""
        if self.kv.allocate_slots(request, request.num_tokens - hit.num_tokens, hit, cache=False) is None:
            return False
        self.fetch_rest(request, hit)
        return True

    def fetch_rest(self, request: Request, hit: PrefixHit) -> None:
        """Load what `hit` lacks into the request's blocks, all allocated already (by `admit`, or by a read from
        this engine's KV tiers that covered part of the prompt)."""
        remote = request.num_tokens - 1  # positions whose KV comes from the producer
        self.loading[request.request_id] = (request, hit)
        if remote > hit.num_tokens:
            block_size = self.kv.block_size
            first_block = hit.num_tokens // block_size
            block_ids = self.kv.block_table(request.request_id)[first_block:-(-remote // block_size)]
            self.loader.start(request, first_block, block_ids)
        else:  # the prefix cache had all of it
            self.loader.skip(request)

    def finished(self) -> tuple[list[tuple[Request, PrefixHit]], list[Request]]:
        """Loads done since the last call: (requests ready to run, with the last prompt token left to compute;
        requests whose load failed, their blocks freed: the caller ends them). Requests aborted meanwhile
        just free their blocks."""
        ready, failed = [], []
        for request_id, error, nbytes, seconds in self.loader.poll():
            request, hit = self.loading.pop(request_id)
            request.kv_transfer_params = None  # loaded: a preemption now recomputes it like any request
            if request.is_finished or error is not None:
                self.kv.free(request_id)
                if not request.is_finished:
                    assert error is not None
                    self.failures.append((request_id, error))
                    failed.append(request)
                continue
            self.kv.cache_full_blocks(request, request.num_tokens - 1)
            self.loaded.append((request_id, nbytes, seconds))
            ready.append((request, hit))
        return ready, failed
