"""KV tiers under the block pool (kv_offload/, core/tier_loads.py): evicted prefix blocks in host memory and on
disk, read back instead of recomputed, across restarts; salts; a slow or full disk never hurts serving."""

from __future__ import annotations

import errno
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import LONG_PARAGRAPH
from tests.engine_utils import run_engine
from tokenmill import LLM
from tokenmill.config import EngineConfig
from tokenmill.engine.core_loop import CoreLoop
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.kv_offload import disk_tier
from tokenmill.kv_offload.disk_tier import DiskTier
from tokenmill.kv_offload.host_tier import HostTier, TierBlock
from tokenmill.kv_offload.identity import kv_namespace
from tokenmill.router.policy import PrefixAwareRouter
from tokenmill.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
# six prompts of ~7 blocks each, unrelated from the first block on, through a pool of 40 blocks
PROMPTS = [f"Session {i}: " + LONG_PARAGRAPH * 2 + f" Question {i}?" for i in range(6)]


def _engine(**options: Any) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(num_kv_blocks=40, **options))


def _run(engine: LLMEngine, prompts: list[Any] = PROMPTS, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(o.token_ids) for o in run_engine(engine, prompts, params)]


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return _run(_engine())


def _block_of(engine: LLMEngine, block_hash: int) -> torch.Tensor | None:
    block = engine.core.kv.pool._cached.get(block_hash)
    return None if block is None else engine.core.executor.read_kv_blocks([block.block_id])[0]


def test_evicted_blocks_come_back_from_host_memory_bit_identical_to_recompute(expected: list[list[int]]) -> None:
    engine = _engine(kv_offload_memory_gb=0.5)
    assert _run(engine) == expected
    tiers = engine.core.tiers
    assert tiers is not None and tiers.stats.blocks_saved > 0 and len(tiers.host) > 0
    assert _run(engine) == expected  # the second pass finds every prompt's blocks in the pool or the tier
    assert tiers.stats.hits["host"] >= 20
    prompt_tokens = sum(len(engine.tokenize_prompt(p)[1]) for p in PROMPTS)
    kv = engine.core.kv
    assert kv.prefix_hits >= prompt_tokens - 6 * 16  # of the second pass: all but the last partial block each

    # the blocks read back hold exactly the bytes a fresh engine computes for that prefix
    fresh = LLMEngine.from_config(EngineConfig(num_kv_blocks=400))
    _run(fresh)
    compared = 0
    for block_hash in list(tiers.host._blocks):
        stored, recomputed = tiers.host._blocks[block_hash].data, _block_of(fresh, block_hash)
        assert recomputed is not None
        assert torch.equal(stored.view(torch.uint8), recomputed.contiguous().view(torch.uint8))
        loaded = _block_of(engine, block_hash)
        if loaded is not None:
            assert torch.equal(loaded.contiguous().view(torch.uint8), stored.view(torch.uint8))
            compared += 1
    assert compared > 0


def test_a_restart_reads_the_prefix_from_disk(tmp_path: Path, expected: list[list[int]]) -> None:
    llm = LLM(num_kv_blocks=40, kv_cache_dir=str(tmp_path))
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    llm.close()  # the pool's blocks go to disk too
    restarted = LLM(num_kv_blocks=40, kv_cache_dir=str(tmp_path))
    outputs = restarted.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    for output in outputs:  # every full block of each prompt but its last token's came from disk
        assert output.num_cached_tokens >= 0.9 * (len(output.prompt_token_ids) - 16), output.num_cached_tokens
    tiers = restarted.engine.core.tiers
    assert tiers is not None and tiers.stats.hits["disk"] >= 36 and tiers.stats.failed_blocks == 0

    # another configuration (here the KV dtype) has a namespace of its own: nothing of the above is read
    other = LLM(num_kv_blocks=40, kv_cache_dir=str(tmp_path), kv_cache_dtype="int8")
    other.generate(PROMPTS[:1], GREEDY)
    assert other.engine.core.tiers is not None and other.engine.core.tiers.stats.hits["disk"] == 0
    assert len(list(tmp_path.iterdir())) == 2


def test_a_cache_aware_router_counts_what_the_tiers_hold(tmp_path: Path) -> None:
    block_bytes = _engine().core.executor.kv_block_bytes  # type: ignore[attr-defined]
    engine = _engine(kv_offload_memory_gb=3 * block_bytes / (1 << 30))  # the host tier holds 3 blocks
    events: list[Any] = []
    engine.core.kv.pool.events = events
    _run(engine)
    _run(engine, PROMPTS[::-1])
    router = PrefixAwareRouter(1, engine.core.kv.block_size)
    router.apply_events(0, events)
    # blocks the pool evicted into the tier still count; those the tier let go do not
    assert router.replicas[0].cached == set(engine.core.held_prefix_blocks())
    assert engine.core.tiers is not None and engine.core.tiers.host is not None
    assert engine.core.tiers.host.evictions > 0 and ("removed", ANY_KEY) in events

    # a restarted engine announces the prefixes it found on disk before its first request
    llm = LLM(num_kv_blocks=40, kv_cache_dir=str(tmp_path))
    llm.generate(PROMPTS, GREEDY)
    llm.close()
    restarted = LLM(num_kv_blocks=40, kv_cache_dir=str(tmp_path))
    reports: list[Any] = []
    loop = CoreLoop(restarted.engine.core, reports.append, kv_events=True)
    loop.run(lambda block: None)
    announced = {key for report in reports for kind, key in report.kv_events if kind == "stored"}
    assert restarted.engine.core.tiers is not None and restarted.engine.core.tiers.disk is not None
    assert announced == set(restarted.engine.core.tiers.disk.keys()) and len(announced) >= 36


class _AnyKey:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, int)


ANY_KEY = _AnyKey()


def _tier_block(seed: int, tokens: tuple[int, ...] = (1, 2, 3)) -> TierBlock:
    return TierBlock(tokens, torch.randint(0, 255, (4, 2, 96), generator=torch.Generator().manual_seed(seed),
                                           dtype=torch.uint8))


def test_corrupt_truncated_and_foreign_files_are_never_served(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, "ns", 1 << 30)
    for key in range(5):
        assert tier.put(key, _tier_block(key))
    files = {key: tier.directory / disk_tier._file_name(key) for key in range(5)}
    raw = files[1].read_bytes()
    files[1].write_bytes(raw[:100] + bytes([raw[100] ^ 1]) + raw[101:])  # a flipped bit
    files[2].write_bytes(files[2].read_bytes()[:-10])  # truncated
    files[3].write_bytes(files[0].read_bytes())  # another key's block under this name
    assert torch.equal(tier.get(0, (1, 2, 3)).data, _tier_block(0).data)  # type: ignore[union-attr]
    assert tier.get(4, (9, 9, 9)) is None  # other tokens under the same hash: not served (the file stays)
    for key in (1, 2, 3):
        assert tier.get(key, (1, 2, 3)) is None and not files[key].exists() and key not in tier
    assert tier.corrupt_removed == 4 and files[4].exists() is False


def test_keys_name_the_model_file_and_the_kv_settings(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights" * 1000)
    settings = {"quantization": "int8", "kv_cache_dtype": "bfloat16", "block_size": 16}
    same = kv_namespace(model, settings)
    assert kv_namespace(model, dict(settings)) == same
    for changed in ({"kv_cache_dtype": "int8"}, {"block_size": 32}, {"quantization": "gguf"}):
        assert kv_namespace(model, settings | changed) != same
    model.write_bytes(b"weights" * 999 + b"other!!")  # another file under the same name
    assert kv_namespace(model, settings) != same


def test_a_full_disk_stops_the_tiers_writes_and_serving_goes_on(tmp_path: Path, expected: list[list[int]],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = open

    def full_disk(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if str(path).endswith(".tmp") and "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", full_disk)
    engine = _engine(kv_cache_dir=str(tmp_path))
    assert _run(engine) == expected
    tiers = engine.core.tiers
    assert tiers is not None and tiers.flush()
    assert tiers.disk is not None and not tiers.disk.writable and len(tiers.disk) == 0
    assert not [p for p in tiers.disk.directory.iterdir() if p.name.endswith(".tmp")]
    assert _run(engine) == expected


def test_two_servers_on_one_directory_leave_only_whole_files(tmp_path: Path) -> None:
    tiers = [DiskTier(tmp_path, "ns", 1 << 30) for _ in range(2)]

    def write(tier: DiskTier, seed: int) -> None:
        for _ in range(20):
            for key in range(8):  # the same keys from both, each time a whole file of its own
                tier._forget(key)  # (so that it writes again)
                tier.put(key, _tier_block(seed))

    threads = [threading.Thread(target=write, args=(tier, i)) for i, tier in enumerate(tiers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    reader = DiskTier(tmp_path, "ns", 1 << 30)
    assert len(reader) > 0
    for key in list(reader._index):
        block = reader.get(key, (1, 2, 3))
        assert block is not None and any(torch.equal(block.data, _tier_block(i).data) for i in range(2))
    assert reader.corrupt_removed == 0


def test_the_disk_tier_drops_the_least_recently_used_past_its_size(tmp_path: Path) -> None:
    size = len(disk_tier.encode_block(0, _tier_block(0)))
    tier = DiskTier(tmp_path, "ns", 3 * size)
    for key in range(3):
        tier.put(key, _tier_block(key))
    assert tier.get(0, (1, 2, 3)) is not None  # 0 is now the most recently used
    tier.put(3, _tier_block(3))
    assert 1 not in tier and {0, 2, 3} <= set(tier._index) and tier.evictions == 1
    assert not (tier.directory / disk_tier._file_name(1)).exists()
    host = HostTier(2 * _tier_block(0).nbytes)
    for key in range(3):
        host.put(key, _tier_block(key))
    assert 0 not in host and host.matches(2, (1, 2, 3)) and not host.matches(2, (1, 2, 4))


def test_salted_requests_share_no_blocks() -> None:
    engine = _engine(kv_offload_memory_gb=0.5)
    text = PROMPTS[0]
    outputs = run_engine(engine, [{"prompt": text, "cache_salt": "tenant-a"}], GREEDY)
    ids = [engine.add_request(None, {"prompt": text, "cache_salt": salt}, GREEDY)
           for salt in ("tenant-a", "tenant-b")] + [engine.add_request(None, text, GREEDY)]
    cached = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                cached[out.request_id] = out.num_cached_tokens
    assert cached[ids[0]] > 0 and cached[ids[1]] == 0 and cached[ids[2]] == 0
    assert outputs[0].token_ids  # (and the same salt shares as before)
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request(None, {"prompt": text, "cache_salt": ""}, GREEDY)


def test_prompt_logprobs_skip_the_tiers(expected: list[list[int]]) -> None:
    engine = _engine(kv_offload_memory_gb=0.5)
    _run(engine)
    _run(engine, PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=1))
    assert engine.core.tiers is not None and engine.core.tiers.stats.hits["host"] == 0


def test_the_step_loop_never_waits_on_a_slow_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  expected: list[list[int]]) -> None:
    """A disk that takes 1.5 s a read: the request whose prefix is on it waits for its load, the others' steps
    go on meanwhile (none of them takes the read's time)."""
    first = _engine(kv_cache_dir=str(tmp_path))
    _run(first, PROMPTS[:1])
    first.core.close()
    real_get = DiskTier.get

    def slow_get(self: DiskTier, key: int, token_ids: tuple[int, ...]) -> Any:
        time.sleep(1.5)
        return real_get(self, key, token_ids)

    monkeypatch.setattr(DiskTier, "get", slow_get)
    engine = _engine(kv_cache_dir=str(tmp_path))
    tiers = engine.core.tiers
    assert tiers is not None
    tiers.disk_read_bytes_per_s = 1e12  # the cost rule takes the disk as fast: it loads
    slow = engine.add_request(None, PROMPTS[0], GREEDY)
    other = engine.add_request(None, "Count: one, two, three,", SamplingParams(max_tokens=12, temperature=0.0))
    steps, finished = [], {}
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = time.perf_counter()
        steps.append(time.perf_counter() - start)
    assert finished[other] < finished[slow]  # it ran to its end while the slow one's prefix was loading
    assert max(steps) < 1.0, steps
    assert tiers.stats.hits["disk"] > 0


def test_a_slow_disk_is_not_read_when_recomputing_is_cheaper(tmp_path: Path, expected: list[list[int]]) -> None:
    first = _engine(kv_cache_dir=str(tmp_path))
    _run(first, PROMPTS[:1])
    first.core.close()
    engine = _engine(kv_cache_dir=str(tmp_path))
    tiers, loads = engine.core.tiers, engine.core.scheduler.tier_loads
    assert tiers is not None and loads is not None
    tiers.disk_read_bytes_per_s = 1e3  # 1 KB/s: a block would take minutes
    assert _run(engine, PROMPTS[:1]) == expected[:1]
    assert tiers.stats.hits["disk"] == 0 and loads.skipped_by_cost == 1


def test_the_server_salts_by_its_header_counts_tier_hits_and_says_so() -> None:
    """`--cache-salt-source header:X-Tenant`: one tenant's second request reads its prefix (from the pool or
    the host tier), another tenant's never, whatever cache_salt it sends; /metrics counts the tier's hits."""
    import httpx
    import openai

    from tests.server_utils import live_server

    with live_server("--num-kv-blocks", "40", "--kv-offload-memory", "0.2",
                     "--cache-salt-source", "header:X-Tenant") as server:
        def cached(tenant: str, prompt: str, salt: str | None = None) -> int:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none",
                                   default_headers={"X-Tenant": tenant})
            extra = {} if salt is None else {"cache_salt": salt}
            model = client.models.list().data[0].id
            reply = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0,
                                              extra_body=extra)
            details = reply.usage.prompt_tokens_details  # type: ignore[union-attr]
            return (details.cached_tokens or 0) if details is not None else 0

        assert cached("a", PROMPTS[0]) == 0
        assert cached("a", PROMPTS[0]) > 0
        assert cached("b", PROMPTS[0]) == 0 and cached("b", PROMPTS[0], salt="x") == 0
        for prompt in PROMPTS[1:]:  # push tenant a's blocks out of the pool into the host tier
            cached("c", prompt)
        assert cached("a", PROMPTS[0]) > 0
        text = httpx.get(server.url + "/metrics").text
        hits = re.search(r'^tokenmill:kv_tier_hit_blocks_total\{[^}]*tier="host"[^}]*\} ([0-9.e+]+)$', text, re.M)
        assert hits is not None and float(hits.group(1)) > 0, text
        bad = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "cache_salt": ""})
        assert bad.status_code == 400 and "cache_salt" in bad.json()["error"]["message"]
