"""The front end over replicas, without a model: fake-executor engine cores in threads, and the core loop's
reports as a process replica would send them."""

from __future__ import annotations

import asyncio
import copy
import pickle

from tests.fakes import make_core, make_request
from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.engine.core_loop import Command, CoreLoop, CoreReport
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.processor import InputProcessor
from tokenmill.engine.replica import Replica, ThreadReplica
from tokenmill.router.policy import LeastLoadRouter
from tokenmill.sampling_params import SamplingParams


def test_a_burst_between_reports_is_spread_by_the_load_routed_since(tokenizer) -> None:  # noqa: ANN001
    """Eight requests submitted before any replica has reported: the router counts what it sent since the last
    report, so least-load alternates instead of sending all eight to the replica that last looked idle."""
    cores = [make_core(num_blocks=256)[0] for _ in range(2)]
    replicas: list[Replica] = [ThreadReplica(i, core) for i, core in enumerate(cores)]
    for replica in replicas:
        replica.launch()
    processor = InputProcessor(cores[0].config, tokenizer, 4096, (2,), 49152, 256 * 4)

    async def run() -> list[int]:
        llm = AsyncLLM(processor, OutputProcessor(tokenizer), replicas, LeastLoadRouter(2))
        chosen: list[int] = []
        llm.route_listeners.append(lambda d: chosen.append(d.replica))
        await llm.start()
        streams = [llm.add_request(f"r{i}", [100 + i] * 40, SamplingParams(max_tokens=6, temperature=0))
                   for i in range(8)]
        for stream in streams:
            outputs = [o async for o in stream]
            assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 6
        await asyncio.sleep(0.1)  # the last reports (after the final steps) acknowledge every add
        assert llm.router.replicas[0].load_tokens == llm.router.replicas[1].load_tokens == 0
        assert llm.num_waiting() == 0
        await llm.shutdown()
        return chosen

    chosen = asyncio.run(run())
    assert sorted(chosen) == [0, 0, 0, 0, 1, 1, 1, 1]
    for core in cores:
        assert core.kv.num_free_blocks == core.kv.num_blocks


def test_reports_carry_what_a_front_end_copy_of_a_request_needs() -> None:
    """A process replica's front end holds pickled copies of its requests: the syncs in the reports must leave
    the copies' timestamps and cache hits equal to the core's, and the KV events must list the cached blocks."""
    core, _ = make_core(num_blocks=64)
    front = [make_request(f"q{i}", 24, max_tokens=5, prefix=[7] * 16) for i in range(3)]
    reports: list[CoreReport] = []
    loop = CoreLoop(core, lambda m: reports.append(pickle.loads(pickle.dumps(m))),  # type: ignore[arg-type]
                    mirror_requests=True, send_plans=False, kv_events=True)
    inside = [copy.deepcopy(r) for r in front]
    pending: list[list[Command]] = [[(1, "add", inside[:2])], [], [], [(2, "add", inside[2:])]]

    def receive(block: bool) -> list[Command] | None:
        if pending:
            return pending.pop(0)
        return None if block else []

    loop.run(receive)
    assert not core.has_unfinished_requests() and reports[-1].acked == 2
    assert all(r.record is None or r.record.plan is None for r in reports)
    by_id = {r.request_id: r for r in front}
    for report in reports:
        for sync in report.syncs:
            sync.apply(by_id[sync.request_id])
    for mine, theirs in zip(front, inside):
        assert mine.times == theirs.times and len(mine.times.token_times) == 5
        assert (mine.num_cached_tokens, mine.num_preemptions) == (theirs.num_cached_tokens, theirs.num_preemptions)
    # the same 40-token prompt: the third finds every full block but the one holding its last token
    assert front[0].num_cached_tokens == 0 and front[2].num_cached_tokens == 36
    stored = [h for report in reports for kind, h in report.kv_events if kind == "stored"]
    assert len(stored) == len(set(stored)) > 0
