"""The data-parallel router's policies, fed by the KV events real KV cache managers publish."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokenmill.core.kv_cache_manager import KVCacheManager, chain_block_hashes
from tokenmill.request import Request
from tokenmill.router.policy import PrefixAwareRouter, RoundRobinRouter, make_router
from tokenmill.sampling_params import SamplingParams

BLOCK = 16


def replica(num_blocks: int = 64) -> KVCacheManager:
    kv = KVCacheManager(num_blocks, BLOCK)
    kv.pool.events = []
    return kv


def serve(kv: KVCacheManager, request_id: str, prompt: list[int]) -> None:
    """Compute a prompt on this replica, as the scheduler would (its full blocks enter the prefix cache)."""
    request = Request(request_id, prompt, SamplingParams(max_tokens=1))
    hit = kv.find_cached_prefix(request)
    assert kv.allocate_slots(request, len(prompt) - hit.num_tokens, hit) is not None
    request.num_computed_tokens = len(prompt)
    kv.free(request_id)  # finished: its blocks stay cached until memory is needed


def publish(router: PrefixAwareRouter, index: int, kv: KVCacheManager) -> None:
    assert kv.pool.events is not None
    router.apply_events(index, kv.pool.events)
    kv.pool.events.clear()


def test_block_hashes_are_the_same_in_every_process() -> None:
    """A router in another process must compute the engines' hashes (hash(None) differs per process)."""
    tokens = list(range(100, 180))
    code = ("from tokenmill.core.kv_cache_manager import chain_block_hashes; "
            f"print(chain_block_hashes({tokens}, {BLOCK}))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert other.strip() == str(chain_block_hashes(tokens, BLOCK))
    assert len(chain_block_hashes(tokens, BLOCK)) == 5


def test_prefix_affinity_balance_threshold_and_eviction() -> None:
    system_a = [1000 + i for i in range(64)]  # a 4-block shared system prompt
    system_b = [5000 + i for i in range(64)]
    kvs = [replica(), replica()]
    router = PrefixAwareRouter(2, BLOCK, balance_abs_threshold=1000, balance_rel_threshold=1.5)

    # nothing cached: the least loaded (ties: the first)
    first = router.route(system_a + [1, 2, 3])
    assert (first.replica, first.reason) == (0, "load")
    serve(kvs[1], "a-0", system_a + [7] * 20)  # replica 1 happens to hold system prompt A
    publish(router, 1, kvs[1])

    # the same prefix goes where it is cached, with the number of leading blocks matched
    decision = router.route(system_a + [9] * 30)
    assert (decision.replica, decision.reason, decision.matched_blocks) == (1, "prefix", 4)  # the system blocks
    # another prefix has no cached blocks anywhere: least loaded
    router.set_load(0, 500)
    other = router.route(system_b + [4] * 10)
    assert (other.replica, other.reason) == (1, "load")

    # out of balance: replica 1 carries far more than replica 0, so A's traffic spills to replica 0
    router.set_load(0, 100)
    router.set_load(1, 5000)
    spilled = router.route(system_a + [9] * 30)
    assert (spilled.replica, spilled.reason) == (0, "load")
    router.set_load(1, 120)  # within the thresholds again: affinity returns
    assert router.route(system_a + [9] * 30).replica == 1

    # replica 1 reuses its memory for other prompts: A's blocks are evicted and the router forgets them
    for i in range(8):
        serve(kvs[1], f"fill-{i}", [20000 + 100 * i + j for j in range(128)])
    publish(router, 1, kvs[1])
    assert not set(chain_block_hashes(system_a, BLOCK)) & router.replicas[1].cached
    assert router.route(system_a + [9] * 30).reason == "load"


def test_dead_replicas_leave_the_rotation_and_forget_their_cache() -> None:
    router = RoundRobinRouter(3)
    router.replicas[1].cached.add(123)
    router.set_alive(1, False)
    assert [router.route([1, 2]).replica for _ in range(4)] == [0, 2, 0, 2]
    assert not router.replicas[1].cached
    router.set_alive(1, True)
    assert sorted({router.route([1]).replica for _ in range(3)}) == [0, 1, 2]
    for i in range(3):
        router.set_alive(i, False)
    with pytest.raises(RuntimeError, match="no replica"):
        router.route([1])
    assert make_router("least-load", 2, BLOCK).route([1]).replica == 0
    with pytest.raises(ValueError, match="unknown router"):
        make_router("random", 2, BLOCK)
