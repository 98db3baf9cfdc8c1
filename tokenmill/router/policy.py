"""Which replica gets a request (`--router round-robin | least-load | prefix-aware`).

The prefix-aware policy mirrors each replica's prefix cache from the KV events its engine publishes (a block
hash stored or removed) and scores a prompt by the number of its leading blocks a replica holds, hashed exactly
as the engines hash them. Load is the replica's waiting + running tokens. As in SGLang's cache-aware router, a
balance check comes first: when the load is too uneven, the least-loaded replica gets the request whatever it
caches, so one hot prefix cannot pile its traffic onto one replica.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tokenmill.core.block_pool import KVEvent
from tokenmill.core.kv_cache_manager import chain_block_hashes

ROUTERS = ("round-robin", "least-load", "prefix-aware")


@dataclass
class ReplicaView:
    """What the router knows of one replica."""

    load_tokens: int = 0  # waiting + running tokens, as last reported
    cached: set[int] = field(default_factory=set)  # block hashes in its prefix cache
    alive: bool = True


@dataclass
class Decision:
    replica: int
    reason: str  # "prefix" (chosen for its cached blocks), "load" (least loaded), "round-robin"
    matched_blocks: int = 0


class Router:
    """Base: replica bookkeeping shared by the policies."""

    name = ""  # the --router value

    def __init__(self, num_replicas: int) -> None:
        self.replicas = [ReplicaView() for _ in range(num_replicas)]
        self.excluded: set[int] = set()  # replicas this router never picks (another role's, disaggregated)

    def alive(self) -> list[int]:
        live = [i for i, r in enumerate(self.replicas) if r.alive and i not in self.excluded]
        if not live:
            raise RuntimeError("no replica is alive")
        return live

    def has_alive(self) -> bool:
        return any(r.alive and i not in self.excluded for i, r in enumerate(self.replicas))

    def set_load(self, replica: int, load_tokens: int) -> None:
        self.replicas[replica].load_tokens = load_tokens

    def set_alive(self, replica: int, alive: bool) -> None:
        view = self.replicas[replica]
        view.alive = alive
        if not alive:  # a restarted replica starts with an empty cache
            view.cached.clear()
            view.load_tokens = 0

    def apply_events(self, replica: int, events: Iterable[KVEvent]) -> None:
        cached = self.replicas[replica].cached
        for kind, block_hash in events:
            if kind == "stored":
                cached.add(block_hash)
            else:
                cached.discard(block_hash)

    def least_loaded(self) -> int:
        return min(self.alive(), key=lambda i: (self.replicas[i].load_tokens, i))

    def route(self, prompt_token_ids: Sequence[int]) -> Decision:
        raise NotImplementedError


class RoundRobinRouter(Router):
    name = "round-robin"

    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas)
        self._next = itertools.count()

    def route(self, prompt_token_ids: Sequence[int]) -> Decision:
        live = self.alive()
        return Decision(live[next(self._next) % len(live)], "round-robin")


class LeastLoadRouter(Router):
    name = "least-load"

    def route(self, prompt_token_ids: Sequence[int]) -> Decision:
        return Decision(self.least_loaded(), "load")


class PrefixAwareRouter(Router):
    """The replica caching the longest prefix of the prompt, unless the load is out of balance: when the most
    loaded replica carries more than `balance_abs_threshold` tokens more than the least, and more than
    `balance_rel_threshold` times as much, the least loaded gets it (SGLang's router has the same two
    thresholds, counted in requests; here in tokens). With no cached prefix anywhere, the least loaded."""

    name = "prefix-aware"

    def __init__(self, num_replicas: int, block_size: int, balance_abs_threshold: int = 4096,
                 balance_rel_threshold: float = 1.5) -> None:
        super().__init__(num_replicas)
        self.block_size = block_size
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def matched_blocks(self, replica: int, hashes: Sequence[int]) -> int:
        cached = self.replicas[replica].cached
        for n, block_hash in enumerate(hashes):
            if block_hash not in cached:
                return n
        return len(hashes)

    def balanced(self) -> bool:
        loads = [self.replicas[i].load_tokens for i in self.alive()]
        low, high = min(loads), max(loads)
        return not (high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold)

    def route(self, prompt_token_ids: Sequence[int]) -> Decision:
        if not self.balanced():
            return Decision(self.least_loaded(), "load")
        # a prompt's last token is always computed, so a block holding it is not a hit (as in the engine)
        hashes = chain_block_hashes(prompt_token_ids[:len(prompt_token_ids) - 1], self.block_size)
        scored = [(self.matched_blocks(i, hashes), -self.replicas[i].load_tokens, -i) for i in self.alive()]
        best, _, negative_index = max(scored)
        if best == 0:
            return Decision(self.least_loaded(), "load")
        return Decision(-negative_index, "prefix", best)


def make_router(name: str, num_replicas: int, block_size: int) -> Router:
    if name == "round-robin":
        return RoundRobinRouter(num_replicas)
    if name == "least-load":
        return LeastLoadRouter(num_replicas)
    if name == "prefix-aware":
        return PrefixAwareRouter(num_replicas, block_size)
    raise ValueError(f"unknown router {name!r}: one of {', '.join(ROUTERS)}")
