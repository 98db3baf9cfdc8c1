"""Physical KV blocks: reference counts, a free queue in eviction (LRU) order, and the prefix-cache index.

A block with ref_count 0 is free, but if it holds a hashed full block it stays findable in the cache until
it is reused for something else: released prefixes survive until memory is actually needed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

# What the prefix-cache index did to a block hash, for whoever mirrors it (a cache-aware router): vLLM's KV
# events, BlockStored and BlockRemoved.
KVEvent = tuple[Literal["stored", "removed"], int]


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()  # the tokens the hash covers, to verify a hit (hashes can collide)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Insertion order = eviction order: the front is the least recently freed block.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}
        self.events: list[KVEvent] | None = None  # set to a list to record index changes; the owner drains it
        # called with the cached blocks `allocate` takes for reuse, [(hash, token ids, block id)], before anything
        # overwrites their KV: the KV tiers under the pool keep them (kv_offload/)
        self.on_evict: Callable[[list[tuple[int, tuple[int, ...], int]]], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Share of blocks referenced by a request (cached but unreferenced blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def holds(self, block_hash: int) -> bool:
        return block_hash in self._cached

    def allocate(self, count: int) -> list[KVBlock]:
        if count > len(self._free):
            raise MemoryError(f"asked for {count} KV blocks, {len(self._free)} free")
        out = []
        evicted: list[tuple[int, tuple[int, ...], int]] = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            kept = self.on_evict is not None and block.block_hash is not None
            if kept and block.block_hash is not None:
                evicted.append((block.block_hash, block.token_ids, block.block_id))
            self._evict(block, kept)
            block.ref_count = 1
            out.append(block)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference; callers pass a request's blocks tail first so tails are evicted first."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} released more often than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block

    def cache_block(self, block: KVBlock, block_hash: int, token_ids: tuple[int, ...]) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:  # an identical block is already indexed: keep the older one
            return
        block.block_hash = block_hash
        block.token_ids = token_ids
        self._cached[block_hash] = block
        if self.events is not None:
            self.events.append(("stored", block_hash))

    def uncache(self, block: KVBlock) -> None:
        """Drop a block from the cache index (it stays allocated to its owners)."""
        self._evict(block)

    def _evict(self, block: KVBlock, kept: bool = False) -> None:
        """Out of the index. `kept`: a KV tier keeps its KV, so the engine still holds the prefix (no "removed"
        event: a cache-aware router keeps counting it as this engine's)."""
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                if self.events is not None and not kept:
                    self.events.append(("removed", block.block_hash))
            block.block_hash = None
            block.token_ids = ()

    def check_integrity(self, owners: dict[str, list[KVBlock]]) -> None:
        """Every block is free xor referenced, and ref counts equal the number of owning requests."""
        counts = [0] * self.num_blocks
        for blocks in owners.values():
            seen = set()
            for block in blocks:
                if block.block_id in seen:
                    raise AssertionError(f"block {block.block_id} appears twice in one block table")
                seen.add(block.block_id)
                counts[block.block_id] += 1
        for block in self.blocks:
            if block.ref_count != counts[block.block_id]:
                raise AssertionError(
                    f"block {block.block_id}: ref_count {block.ref_count} != {counts[block.block_id]} owners"
                )
            if (block.ref_count == 0) != (block.block_id in self._free):
                raise AssertionError(f"block {block.block_id}: free queue disagrees with ref_count")
        for block_hash, block in self._cached.items():
            if block.block_hash != block_hash:
                raise AssertionError(f"cache index points at block {block.block_id} with another hash")
