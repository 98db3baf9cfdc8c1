"""Block tables per request: on-demand allocation, release, and prefix lookup by chained block hashes.

A full block's hash chains its parent's hash with its own token ids, so equal hashes mean equal prefixes (and
the token ids are compared on every hit, so a hash collision can never serve wrong KV). Blocks are hashed as
soon as the tokens that fill them are scheduled: the forward pass writes every layer's K/V before any attention
reads it, so a request scheduled in the same step may already share them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.core.block_pool import BlockPool, KVBlock
from tokenmill.request import Request

# The parent of a sequence's first block. A constant, so that every process hashes a prefix alike and a router
# can compute the engines' hashes (Python < 3.12 hashes None by address, different in each process).
ROOT_HASH = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chain_block_hashes(token_ids: Sequence[int], block_size: int, hashes: list[int] | None = None,
                       salt: int = 0) -> list[int]:
    """The chained hashes of the full blocks of `token_ids`, extending `hashes` (those of its leading blocks);
    a nonzero `salt` starts a chain of its own."""
    hashes = [] if hashes is None else hashes
    parent = hashes[-1] if hashes else ROOT_HASH if not salt else hash((ROOT_HASH, salt))
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        hashes.append(parent)
    return hashes


@dataclass
class PrefixHit:
    blocks: list[KVBlock]
    num_tokens: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}  # the same, as ids (every step's plan copies them)
        self._num_hashed: dict[str, int] = {}  # leading blocks of each request already in the cache index
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in the cache

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_table(self, request_id: str) -> list[int]:
        return list(self._block_ids.get(request_id, ()))

    def num_allocated_blocks(self, request_id: str) -> int:
        return len(self.req_blocks.get(request_id, ()))

    def _update_hashes(self, request: Request) -> None:
        chain_block_hashes(request.all_token_ids, self.block_size, request.block_hashes, request.cache_salt)

    def find_cached_prefix(self, request: Request) -> PrefixHit:
        """Longest run of cached full blocks; at least one token is always left to compute."""
        if not self.enable_caching:
            return PrefixHit([], 0)
        self._update_hashes(request)
        if request.needs_prompt_logprobs:  # a cached block has no logits: compute them all (vLLM's rule)
            return PrefixHit([], 0)
        bs = self.block_size
        hits: list[KVBlock] = []
        for i in range((request.num_tokens - 1) // bs):
            block = self.pool.lookup(request.block_hashes[i], tuple(request.all_token_ids[i * bs:(i + 1) * bs]))
            if block is None:
                break
            hits.append(block)
        return PrefixHit(hits, len(hits) * bs)

    def record_prefix_query(self, num_tokens: int, num_hits: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hits

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None,
                       reserve_tokens: int = 0, cache: bool = True) -> list[KVBlock] | None:
        """Make room for `num_new_tokens` after the computed ones (and cache hits); None when out of blocks.

        `reserve_tokens` asks for capacity up to that many tokens at once (static batching reserves a
        request's maximum length up front). `cache=False` leaves the new full blocks out of the prefix-cache
        index (their KV is filled later, by a transfer: `cache_full_blocks` then). Nothing is changed when the
        answer is None.
        """
        blocks = self.req_blocks.setdefault(request.request_id, [])
        hit_blocks = hit.blocks if hit else []
        num_computed = request.num_computed_tokens + (hit.num_tokens if hit else 0)
        needed = cdiv(max(num_computed + num_new_tokens, reserve_tokens), self.block_size)
        to_allocate = max(0, needed - len(blocks) - len(hit_blocks))
        # Cache hits that sit in the free queue stop being allocatable once this request takes them.
        hits_in_free_queue = sum(1 for b in hit_blocks if b.ref_count == 0)
        if to_allocate > self.pool.num_free_blocks - hits_in_free_queue:
            if not blocks:
                del self.req_blocks[request.request_id]
            return None
        self.pool.touch(hit_blocks)
        blocks.extend(hit_blocks)
        new_blocks = self.pool.allocate(to_allocate)
        blocks.extend(new_blocks)
        self._block_ids.setdefault(request.request_id, []).extend(b.block_id for b in hit_blocks + new_blocks)
        if cache:
            self.cache_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the request's full blocks holding its first `num_tokens` tokens in the prefix cache."""
        if not self.enable_caching:
            return
        self._update_hashes(request)
        blocks = self.req_blocks[request.request_id]
        start = self._num_hashed.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        bs = self.block_size
        for i in range(start, end):
            self.pool.cache_block(blocks[i], request.block_hashes[i],
                                  tuple(request.all_token_ids[i * bs:(i + 1) * bs]))
        self._num_hashed[request.request_id] = max(start, end)

    def forget_cached_blocks(self, request_id: str, from_token: int) -> None:
        """Take the request's blocks holding positions >= from_token out of the prefix-cache index (their KV
        was never completely written)."""
        blocks = self.req_blocks.get(request_id, [])
        first = from_token // self.block_size
        for block in blocks[first:]:
            self.pool.uncache(block)
        if request_id in self._num_hashed:
            self._num_hashed[request_id] = min(self._num_hashed[request_id], first)

    def free(self, request_id: str) -> None:
        blocks = self.req_blocks.pop(request_id, [])
        self._block_ids.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        self.pool.release(reversed(blocks))  # tail blocks become the first to be evicted

    def check_integrity(self) -> None:
        self.pool.check_integrity(self.req_blocks)
        assert self._block_ids == {r: [b.block_id for b in blocks] for r, blocks in self.req_blocks.items()}
