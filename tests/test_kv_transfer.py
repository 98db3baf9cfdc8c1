"""Prefill/decode disaggregation: the KV transports, the runner's block reads and writes, and a prefill engine
handing prompts to a decode engine (in-process here; tests/test_disaggregated.py runs the processes)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from typing import Any

import pytest
import torch

from tests.conftest import LONG_PARAGRAPH, PLAIN_PROMPTS
from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.replica import Replica, ThreadReplica
from tokenmill.kv_transfer.connector import (
    KVBlocks,
    KVTransferError,
    SharedMemoryConnector,
    TCPConnector,
    make_connector,
)
from tokenmill.kv_transfer.loader import BackgroundKVLoader
from tokenmill.request import Request
from tokenmill.router.policy import make_router
from tokenmill.sampling_params import SamplingParams


def blocks(n: int = 5) -> KVBlocks:
    return KVBlocks(torch.randn(n, 3, 2, 64), list(range(100, 100 + n - 1)), n * 16 - 3)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_transport_round_trip_partial_fetch_release(transport: str) -> None:
    producer, consumer = make_connector(transport), make_connector(transport, serve=False)
    try:
        saved = blocks()
        params = producer.save("r1", saved)
        assert producer.pending() == 1 and params["block_hashes"] == saved.block_hashes
        assert torch.equal(consumer.load(params, 0), saved.data)
        assert torch.equal(consumer.load(params, 2, 4), saved.data[2:4])  # only the blocks it lacks
        producer.release("r1")
        assert producer.pending() == 0
        with pytest.raises(KVTransferError):
            consumer.load(params, 0)
    finally:
        producer.close()
        consumer.close()


def test_shared_memory_corruption_and_a_vanished_file_are_detected() -> None:
    producer = SharedMemoryConnector()
    try:
        saved = blocks()
        params = producer.save("r1", saved)
        block_nbytes = 3 * 2 * 64 * 4
        with open(params["path"], "r+b") as f:
            f.seek(3 * block_nbytes + 17)
            byte = f.read(1)
            f.seek(3 * block_nbytes + 17)
            f.write(bytes([byte[0] ^ 0xFF]))
        assert torch.equal(SharedMemoryConnector().load(params, 0, 3), saved.data[:3])  # blocks before it are fine
        with pytest.raises(KVTransferError, match="block 3 failed its checksum"):
            SharedMemoryConnector().load(params, 0)
        os.unlink(params["path"])
        with pytest.raises(KVTransferError, match="gone"):
            SharedMemoryConnector().load(params, 0)
    finally:
        producer.close()


class RecordingExecutor:
    def __init__(self) -> None:
        self.writes: list[tuple[list[int], torch.Tensor]] = []

    def write_kv_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        self.writes.append((block_ids, data.clone()))


def test_the_loader_stores_one_piece_per_poll_and_reports_failures() -> None:
    producer = SharedMemoryConnector()
    executor = RecordingExecutor()
    block_bytes = 3 * 2 * 64 * 4
    loader = BackgroundKVLoader(producer, executor, piece_bytes=2 * block_bytes)
    try:
        saved = blocks(5)
        request = Request("r1", [1] * 77, SamplingParams())
        request.kv_transfer_params = producer.save("r1", saved)
        loader.start(request, 0, [10, 11, 12, 13, 14])
        done: list[tuple[str, str | None, int, float]] = []
        polls = 0
        while not done:
            loader.wait(1.0)
            writes_before = len(executor.writes)
            done = loader.poll()
            assert len(executor.writes) - writes_before <= 1  # never more than one piece per step
            polls += 1
            assert polls < 100
        assert [ids for ids, _ in executor.writes] == [[10, 11], [12, 13], [14]]
        assert torch.equal(torch.cat([data for _, data in executor.writes]), saved.data)
        assert done == [("r1", None, saved.data.numel() * 4, pytest.approx(done[0][3]))]
        os.unlink(request.kv_transfer_params["path"])  # gone before the next request's fetch
        loader.start(request, 0, [10, 11, 12, 13, 14])
        failed: list[tuple[str, str | None, int, float]] = []
        while not failed:
            loader.wait(1.0)
            failed = loader.poll()
        assert failed[0][0] == "r1" and "gone" in (failed[0][1] or "")
        skipped = Request("r2", [1] * 9, SamplingParams())
        loader.skip(skipped)
        loader.wait(1.0)
        assert loader.poll() == [("r2", None, 0, 0.0)]
    finally:
        loader.close()
        producer.close()


def test_tcp_corruption_and_silent_server_fail_within_the_timeout() -> None:
    producer = TCPConnector()
    consumer = TCPConnector(serve=False, timeout=0.5)
    try:
        params = producer.save("r1", blocks())
        header, raw = producer._saved["r1"]
        broken = bytearray(raw)
        broken[5] ^= 0x01
        producer._saved["r1"] = (header, bytes(broken))  # corrupted at rest: the per-block CRC catches it
        with pytest.raises(KVTransferError, match="block 0 failed its checksum"):
            consumer.load(params, 0)
        # a server that accepts and never answers
        silent = socket.create_server(("127.0.0.1", 0))
        started = time.monotonic()
        with pytest.raises(KVTransferError):
            consumer.load({**params, "host": "127.0.0.1", "port": silent.getsockname()[1]}, 0)
        assert time.monotonic() - started < 5
        silent.close()
    finally:
        producer.close()


def test_runner_reads_and_writes_kv_blocks(llm) -> None:  # noqa: ANN001
    runner = llm.engine.core.executor
    data = runner.read_kv_blocks([1, 2])
    kept = runner.read_kv_blocks([5, 7])  # the shared engine's prefix cache may index these blocks: put them back
    try:
        new = torch.randn_like(data)
        runner.write_kv_blocks([5, 7], new)
        assert torch.equal(runner.read_kv_blocks([5, 7]), new)
        runner.write_kv_blocks([5, 7], runner.read_kv_blocks([1, 2]))
        assert torch.equal(runner.read_kv_blocks([5, 7]), data)
    finally:
        runner.write_kv_blocks([5, 7], kept)
    assert torch.equal(runner.read_kv_blocks([5, 7]), kept)


def test_8bit_kv_blocks_move_as_stored_and_other_formats_are_refused(loaded_model) -> None:  # noqa: ANN001
    from tokenmill.executor.model_runner import ModelRunner

    def runner(kv: str) -> ModelRunner:
        config = EngineConfig(quantization="int8", kv_cache_dtype=kv, num_kv_blocks=8)
        return ModelRunner(config, loaded_model.config, loaded_model.weights)

    source, target = runner("int8"), runner("int8")
    for cache in source.kv_caches:  # distinct bytes in every tensor of every layer
        for tensor in cache.tensors:
            tensor.view(torch.uint8).copy_(torch.randint(0, 256, tensor.view(torch.uint8).shape, dtype=torch.uint8))
    data = source.read_kv_blocks([1, 2])
    assert data.dtype == torch.uint8 and data.shape[-1] == source.kv_caches[0].block_bytes // 2
    target.write_kv_blocks([5, 7], data)
    for mine, theirs in zip(target.kv_caches, source.kv_caches):
        for a, b in zip(mine.tensors, theirs.tensors, strict=True):
            assert torch.equal(a[[5, 7]].view(torch.uint8), b[[1, 2]].view(torch.uint8))
    with pytest.raises(ValueError, match="do not fit this engine's fp8_e4m3 cache"):
        runner("fp8").write_kv_blocks([0], runner("bfloat16").read_kv_blocks([0]))
    with pytest.raises(ValueError, match="do not fit this engine's bfloat16 cache"):
        runner("bfloat16").write_kv_blocks([0], data[:1])


@pytest.mark.parametrize(("transport", "kv_dtype"), [("shm", "auto"), ("tcp", "auto"), ("shm", "int8")])
def test_prefill_engine_hands_prompts_to_a_decode_engine_with_identical_greedy_outputs(
        llm, loaded_model, tokenizer, transport: str, kv_dtype: str) -> None:  # noqa: ANN001
    """1P1D in one process (engine cores in threads): outputs equal the colocated engine's, the decode engine
    fetches only blocks its prefix cache lacks, and afterwards no block and no saved KV is left on either side,
    including for a request closed right after its hand-off. An int8 cache moves as stored (values and scales)."""
    from tokenmill import LLM

    # an 8-bit cache over the batch-invariant int8 linears: float32 GEMMs of other batch shapes could round a
    # K value to the neighbouring 8-bit one
    quantization = "none" if kv_dtype == "auto" else "int8"
    if kv_dtype != "auto":
        llm = LLM(quantization=quantization, kv_cache_dtype=kv_dtype)  # the colocated reference
    prompts = PLAIN_PROMPTS + ["You are a pirate. " + LONG_PARAGRAPH * 3 + q for q in ("Why?", "How?")]
    params = SamplingParams(max_tokens=12, temperature=0)
    expected = [o.outputs[0].text for o in llm.generate(prompts, params)]
    engines = [LLMEngine.from_loaded(EngineConfig(quantization=quantization, kv_role=role, kv_transport=transport,
                                                  kv_cache_dtype=kv_dtype),
                                     loaded_model, tokenizer) for role in ("producer", "consumer")]
    replicas: list[Replica] = [ThreadReplica(i, e.core) for i, e in enumerate(engines)]
    for replica in replicas:
        replica.launch()
    transfers: dict[str, int] = {}  # engine request -> KV bytes moved

    scoring = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
    [colocated] = llm.generate(prompts[-1], scoring)
    scored = []

    async def run() -> list[str]:
        front = AsyncLLM(engines[0].processor, engines[0].output_processor, replicas,
                         make_router("prefix-aware", 2, 16))
        front.transfer_listeners.append(lambda request_id, nbytes, *_: transfers.__setitem__(request_id, nbytes))
        await front.start()

        async def one(i: int, prompt: str) -> str:
            text = ""
            async for out in front.generate(f"p{i}", prompt, params):
                text = out.outputs[0].text
            return text

        texts = list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts[:-1]))))
        texts.append(await one(len(prompts) - 1, prompts[-1]))  # after its twin: a prefix hit on the decode side
        # prompt logprobs come from the prefill engine, with the decode engine's first output
        scored.extend([out async for out in front.generate("scored", prompts[-1], scoring)][-1:])
        # closed right after the hand-off: nothing may stay behind
        stream = front.add_request("gone", prompts[0], SamplingParams(max_tokens=200, ignore_eos=True))
        while front.handoffs.inflight.get("gone") is None or front.handoffs.inflight["gone"].decode_at is None:
            await asyncio.sleep(0.005)
        stream.close()
        await asyncio.sleep(0.3)
        await front.shutdown()
        return texts

    try:
        texts = asyncio.run(run())
        assert texts == expected
        assert scored[0].prompt_logprobs is not None and colocated.prompt_logprobs is not None
        assert len(scored[0].prompt_logprobs) == len(colocated.prompt_logprobs) == len(colocated.prompt_token_ids)
        for a, b in zip(scored[0].prompt_logprobs[1:], colocated.prompt_logprobs[1:]):
            assert a is not None and b is not None and a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
        assert {f"p{i}" for i in range(len(prompts))} <= set(transfers)  # ("gone" may not have loaded)
        # the second pirate prompt found the shared blocks in the decode engine's cache: fewer bytes moved
        first, second = transfers[f"p{len(prompts) - 2}"], transfers[f"p{len(prompts) - 1}"]
        assert 0 < second < first / 4
        for engine in engines:
            assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks
            assert not engine.core.has_unfinished_requests()
        assert engines[0].core.connector is not None and engines[0].core.connector.pending() == 0
    finally:
        for engine in engines:
            if engine.core.connector is not None:
                engine.core.connector.close()
    assert threading.active_count() < 50


def test_a_decode_engine_reads_an_evicted_prefix_from_its_own_kv_tier(llm, loaded_model, tokenizer) -> None:  # noqa: ANN001
    """The decode engine's pool evicted a session's blocks into its host-memory tier: the session's next prompt
    reads them back from there and fetches only the rest from the prefill engine; greedy outputs as colocated."""
    sessions = [f"Session {i}. " + LONG_PARAGRAPH * 10 for i in range(3)]  # ~35 blocks each, a pool of 48
    prompts = [*sessions, sessions[0] + " And why?"]  # the last one resends the first session's history
    params = SamplingParams(max_tokens=8, temperature=0)
    expected = [o.outputs[0].text for o in llm.generate(prompts, params)]
    options: list[dict[str, Any]] = [{}, {"num_kv_blocks": 48, "kv_offload_memory_gb": 0.25}]
    engines = [LLMEngine.from_loaded(EngineConfig(quantization="none", kv_role=role, kv_transport="shm", **extra),
                                     loaded_model, tokenizer)
               for role, extra in zip(("producer", "consumer"), options, strict=True)]
    replicas: list[Replica] = [ThreadReplica(i, e.core) for i, e in enumerate(engines)]
    for replica in replicas:
        replica.launch()
    transfers: dict[str, int] = {}

    async def run() -> list[str]:
        front = AsyncLLM(engines[0].processor, engines[0].output_processor, replicas,
                         make_router("prefix-aware", 2, 16))
        front.transfer_listeners.append(lambda request_id, nbytes, *_: transfers.__setitem__(request_id, nbytes))
        await front.start()
        texts = []
        for i, prompt in enumerate(prompts):  # one at a time: the first session's blocks leave the pool
            async for out in front.generate(f"s{i}", prompt, params):
                text = out.outputs[0].text
            texts.append(text)
        await front.shutdown()
        return texts

    try:
        assert asyncio.run(run()) == expected
        consumer = engines[1].core
        assert consumer.tiers is not None and consumer.tiers.stats.hits["host"] >= 10
        assert 0 < transfers["s3"] < transfers["s0"] / 4  # the history came from the tier, not the producer
        assert consumer.kv.num_free_blocks == consumer.kv.num_blocks and not consumer.has_unfinished_requests()
    finally:
        for engine in engines:
            if engine.core.connector is not None:
                engine.core.connector.close()
