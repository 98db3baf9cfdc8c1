"""Scheduler behaviour on a fake executor: budgets, chunked prefill, prefix caching, preemption, policies,
batching modes, stops, aborts, and no leaked blocks."""

from __future__ import annotations

import pytest

from tests.fakes import EOS, FakeClock, FakeExecutor, check_step, make_core, make_request, run_to_completion
from tokenmill.request import RequestStatus


def test_every_step_within_budget_and_cap_and_nothing_leaks() -> None:
    clock = FakeClock()
    core, executor = make_core(num_blocks=64, clock=clock, max_num_batched_tokens=16, max_num_seqs=4)
    for i in range(12):
        core.add_request(make_request(f"r{i}", prompt_len=5 + 7 * i, max_tokens=3 + i % 5, clock=clock))
    outputs = run_to_completion(core)
    assert len(outputs) == 12
    assert all(len(outputs[f"r{i}"]) == 3 + i % 5 for i in range(12))
    assert core.kv.num_free_blocks == core.kv.num_blocks
    assert not core.kv.req_blocks
    assert max(p.total_tokens for p in executor.plans) == 16


def test_long_prompt_is_chunked_and_decodes_are_never_starved() -> None:
    clock = FakeClock()
    core, executor = make_core(num_blocks=128, clock=clock, max_num_batched_tokens=8, max_num_seqs=8)
    for i in range(3):
        core.add_request(make_request(f"short{i}", prompt_len=2, max_tokens=40, clock=clock))
    core.step()  # the short prompts are admitted (and finish prefill) in one step
    core.add_request(make_request("long", prompt_len=100, max_tokens=2, clock=clock))
    chunk_steps = 0
    while core.scheduler.requests.get("long") and core.scheduler.requests["long"].num_output_tokens == 0:
        core.step()
        plan = executor.plans[-1]
        by_id = {s.request_id: s for s in plan.scheduled}
        assert all(f"short{i}" in by_id and by_id[f"short{i}"].num_tokens == 1 for i in range(3)), by_id.keys()
        if "long" in by_id:
            chunk_steps += 1
            assert by_id["long"].num_tokens <= 8 - 3
        check_step(core)
    assert chunk_steps >= 100 // 5


def test_partial_prefill_cap_limits_concurrent_chunked_prompts() -> None:
    core, executor = make_core(num_blocks=256, max_num_batched_tokens=16, max_num_partial_prefills=1)
    for i in range(3):
        core.add_request(make_request(f"long{i}", prompt_len=60, max_tokens=1))
    for _ in range(6):
        core.step()
        partial = [s for s in executor.plans[-1].scheduled if not s.sample]
        assert len(partial) <= 1


def test_without_chunked_prefill_prompts_run_whole_in_arrival_order() -> None:
    with pytest.raises(ValueError, match="at least max_model_len"):
        make_core(max_model_len=64, max_num_batched_tokens=32, enable_chunked_prefill=False)
    core, executor = make_core(num_blocks=256, max_model_len=64, max_num_batched_tokens=64,
                               enable_chunked_prefill=False, enable_prefix_caching=False)
    lengths = [40, 30, 20, 64, 5]
    for i, n in enumerate(lengths):
        core.add_request(make_request(f"r{i}", prompt_len=n, max_tokens=1, pool=True))
    outputs = run_to_completion(core)
    assert set(outputs) == {f"r{i}" for i in range(len(lengths))}
    steps = [[(s.request_id, s.start_position, s.num_tokens) for s in p.scheduled] for p in executor.plans
             if p.scheduled]
    # each prompt in one step, whole; one that does not fit what is left of the budget waits for the next step,
    # and the ones behind it wait too (no chunk of it, no overtaking); an input of max_model_len fits (it samples
    # nothing)
    assert steps == [[("r0", 0, 40)], [("r1", 0, 30), ("r2", 0, 20)], [("r3", 0, 64)], [("r4", 0, 5)]]
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_prefix_cache_hits_share_blocks_and_report_cached_tokens() -> None:
    clock = FakeClock()
    core, _ = make_core(num_blocks=64, clock=clock, block_size=4, max_num_batched_tokens=64)
    prefix = list(range(200, 224))  # 24 tokens = 6 full blocks
    core.add_request(make_request("a", prompt_len=5, prefix=prefix, clock=clock))
    core.step()
    core.add_request(make_request("b", prompt_len=3, prefix=prefix, clock=clock))
    core.step()
    a, b = core.scheduler.requests["a"], core.scheduler.requests["b"]
    assert b.num_cached_tokens == 24 and a.num_cached_tokens == 0
    shared = set(core.kv.block_table("a")[:6]) & set(core.kv.block_table("b")[:6])
    assert len(shared) == 6
    assert core.kv.prefix_hits == 24
    run_to_completion(core)
    # released but still cached: a third request hits without anyone running
    core.add_request(make_request("cc", prompt_len=9, prefix=prefix, clock=clock))  # suffix differs from a
    core.step()
    assert core.scheduler.requests["cc"].num_cached_tokens == 24
    run_to_completion(core)
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_prefix_hit_never_covers_the_whole_prompt() -> None:
    core, _ = make_core(num_blocks=32, block_size=4)
    prefix = list(range(300, 316))
    core.add_request(make_request("a", prompt_len=0, prefix=prefix, max_tokens=1))
    run_to_completion(core)
    core.add_request(make_request("b", prompt_len=0, prefix=prefix, max_tokens=1))
    core.step()
    assert core.scheduler.requests.get("b") is None or core.scheduler.requests["b"].num_cached_tokens == 12


def test_lru_eviction_reuses_free_cached_blocks_when_memory_is_needed() -> None:
    core, _ = make_core(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    core.add_request(make_request("a", prompt_len=16, max_tokens=1))
    run_to_completion(core)
    assert core.kv.pool.num_free_blocks == 8 and core.kv.pool._cached
    core.add_request(make_request("b", prompt_len=28, max_tokens=2))  # needs every block
    outputs = run_to_completion(core)
    assert len(outputs["b"]) == 2


def test_preemption_when_blocks_run_out_then_recompute() -> None:
    clock = FakeClock()
    core, _ = make_core(num_blocks=12, clock=clock, block_size=4, max_num_batched_tokens=64, max_num_seqs=4)
    for i in range(4):
        core.add_request(make_request(f"r{i}", prompt_len=6, max_tokens=12, clock=clock))
        clock.now += 0.001
    outputs = run_to_completion(core)
    assert core.scheduler.total_preemptions > 0
    assert all(len(outputs[f"r{i}"]) == 12 for i in range(4))
    # the outputs are what each request produces alone (the fake model is a function of id and position)
    for i in range(4):
        alone, _ = make_core(num_blocks=64, block_size=4)
        alone.add_request(make_request(f"r{i}", prompt_len=6, max_tokens=12))
        assert run_to_completion(alone)[f"r{i}"] == outputs[f"r{i}"]


def test_victim_is_latest_arrival_under_fcfs_and_recomputed_tokens_are_counted() -> None:
    clock = FakeClock()
    core, _ = make_core(num_blocks=6, clock=clock, block_size=4, max_num_batched_tokens=64)
    core.add_request(make_request("old", prompt_len=7, max_tokens=12, clock=clock))
    clock.now += 1
    core.add_request(make_request("new", prompt_len=7, max_tokens=12, clock=clock))
    requests = {"old": core.scheduler.requests["old"], "new": core.scheduler.requests["new"]}
    run_to_completion(core)
    assert requests["new"].num_preemptions > 0
    assert requests["old"].num_preemptions == 0
    assert requests["new"].num_recomputed_tokens > 0


def test_priority_victim_is_lowest_priority() -> None:
    clock = FakeClock()
    core, _ = make_core(num_blocks=6, clock=clock, block_size=4, max_num_batched_tokens=64, policy="priority",
                        priority_aging_per_s=0.0)
    core.add_request(make_request("low", prompt_len=7, max_tokens=12, clock=clock, priority=5))
    clock.now += 1
    core.add_request(make_request("high", prompt_len=7, max_tokens=12, clock=clock, priority=0))
    low, high = core.scheduler.requests["low"], core.scheduler.requests["high"]
    run_to_completion(core)
    assert low.num_preemptions > 0 and high.num_preemptions == 0


def test_fcfs_order_with_one_slot() -> None:
    clock = FakeClock()
    core, _ = make_core(clock=clock, max_num_seqs=1)
    finished = []
    for i in range(5):
        core.add_request(make_request(f"r{i}", prompt_len=3, max_tokens=2, clock=clock))
        clock.now += 0.01
    while core.has_unfinished_requests():
        finished += [o.request_id for o in core.step() if o.finish_reason]
    assert finished == [f"r{i}" for i in range(5)]


def test_priority_order_and_aging_prevents_starvation() -> None:
    clock = FakeClock()
    executor = FakeExecutor(64, clock, step_seconds=0.1)
    core, _ = make_core(clock=clock, executor=executor, max_num_seqs=1, policy="priority",
                        priority_aging_per_s=1.0)
    core.add_request(make_request("low", prompt_len=3, max_tokens=2, clock=clock, priority=10))
    core.add_request(make_request("high", prompt_len=3, max_tokens=2, clock=clock, priority=0))
    order = []
    # a stream of new high-priority requests keeps arriving
    for step in range(400):
        if step % 2 == 0:
            core.add_request(make_request(f"h{step}", prompt_len=3, max_tokens=2, clock=clock, priority=0))
        order += [o.request_id for o in core.step() if o.finish_reason]
        if "low" in order:
            break
    assert order[0] == "high"
    assert "low" in order  # aged past the newcomers after ~10 s of waiting
    waited = core.scheduler.requests  # noqa: F841 - keep the engine alive until the assertion
    assert order.index("low") < 200


def test_priority_without_aging_starves_low_priority() -> None:
    """Guard for the test above: it is aging, not luck, that lets the low-priority request run."""
    clock = FakeClock()
    executor = FakeExecutor(64, clock, step_seconds=0.1)
    core, _ = make_core(clock=clock, executor=executor, max_num_seqs=1, policy="priority", priority_aging_per_s=0.0)
    core.add_request(make_request("low", prompt_len=3, max_tokens=2, clock=clock, priority=10))
    order = []
    for step in range(200):
        if step % 2 == 0:
            core.add_request(make_request(f"h{step}", prompt_len=3, max_tokens=2, clock=clock, priority=0))
        order += [o.request_id for o in core.step() if o.finish_reason]
    assert "low" not in order


def test_stream_of_short_requests_does_not_starve_a_long_one() -> None:
    clock = FakeClock()
    core, _ = make_core(num_blocks=256, clock=clock, max_num_batched_tokens=32, max_num_seqs=4)
    core.add_request(make_request("s0", prompt_len=4, max_tokens=4, clock=clock))
    core.add_request(make_request("long", prompt_len=300, max_tokens=4, clock=clock))
    done_at = None
    for step in range(500):
        core.add_request(make_request(f"s{step + 1}", prompt_len=4, max_tokens=4, clock=clock))
        if any(o.request_id == "long" and o.finish_reason for o in core.step()):
            done_at = step
            break
    assert done_at is not None and done_at < 60


def test_abort_in_every_state_frees_everything() -> None:
    clock = FakeClock()
    core, _ = make_core(num_blocks=10, clock=clock, block_size=4, max_num_batched_tokens=8, max_num_seqs=3)
    core.add_request(make_request("decoding", prompt_len=3, max_tokens=50, clock=clock))
    core.step()
    core.step()
    core.add_request(make_request("prefilling", prompt_len=20, max_tokens=50, clock=clock))
    core.add_request(make_request("waiting", prompt_len=3, max_tokens=50, clock=clock))
    core.step()
    states = {rid: r.status for rid, r in core.scheduler.requests.items()}
    assert states["decoding"] == RequestStatus.RUNNING
    prefilling = core.scheduler.requests["prefilling"]
    assert prefilling.status == RequestStatus.RUNNING and prefilling.num_computed_tokens < 20
    assert states["waiting"] == RequestStatus.WAITING
    # drive until something is preempted, then abort it while preempted
    for _ in range(60):
        core.step()
        if any(r.status == RequestStatus.PREEMPTED for r in core.scheduler.requests.values()):
            break
    preempted = [rid for rid, r in core.scheduler.requests.items() if r.status == RequestStatus.PREEMPTED]
    assert preempted
    assert core.abort_requests(preempted) == preempted
    assert core.abort_requests(["no-such-id"]) == []
    core.scheduler.check_integrity()
    core.abort_requests(list(core.scheduler.requests))
    core.scheduler.check_integrity()
    assert core.kv.num_free_blocks == core.kv.num_blocks and not core.has_unfinished_requests()
    core.step()  # an idle step after aborts is harmless


def test_stops_eos_stop_token_max_tokens_and_context_limit() -> None:
    clock = FakeClock()
    executor = FakeExecutor(64, clock, eos_at={"eos": 3, "ignore": 3})
    core, _ = make_core(clock=clock, executor=executor, max_model_len=20)
    core.add_request(make_request("eos", prompt_len=3, max_tokens=10, clock=clock))
    core.add_request(make_request("ignore", prompt_len=3, max_tokens=10, clock=clock, ignore_eos=True))
    core.add_request(make_request("length", prompt_len=3, max_tokens=5, clock=clock))
    core.add_request(make_request("context", prompt_len=15, max_tokens=100, clock=clock))
    first = make_request("stop_id", prompt_len=3, max_tokens=10, clock=clock)
    stop_token = 10 + (__import__("zlib").crc32(b"stop_id") + 3 + 2) % 1000  # its third output token
    first.sampling_params.stop_token_ids = [stop_token]
    core.add_request(first)
    reasons = {}
    outputs = {}
    while core.has_unfinished_requests():
        for o in core.step():
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                reasons[o.request_id] = (o.finish_reason, o.stop_reason)
    assert reasons["eos"] == ("stop", None) and outputs["eos"][-1] == EOS and len(outputs["eos"]) == 4
    assert reasons["ignore"] == ("length", None) and len(outputs["ignore"]) == 10
    assert reasons["length"] == ("length", None) and len(outputs["length"]) == 5
    assert reasons["context"] == ("length", None) and len(outputs["context"]) == 20 - 15
    assert reasons["stop_id"] == ("stop", stop_token) and len(outputs["stop_id"]) == 3


def test_a_lone_request_longer_than_the_pool_stops_at_pool_capacity() -> None:
    core, _ = make_core(num_blocks=4, block_size=4, max_model_len=100)
    core.add_request(make_request("big", prompt_len=6, max_tokens=50))
    outputs = run_to_completion(core)
    assert len(outputs["big"]) == 16 - 6


def test_prompt_that_cannot_fit_is_rejected_not_left_hanging() -> None:
    core, _ = make_core(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(ValueError, match="maximum context length"):
        core.add_request(make_request("too-long", prompt_len=100))
    with pytest.raises(ValueError, match="KV cache"):
        core.add_request(make_request("too-big-for-pool", prompt_len=40))
    core.add_request(make_request("ok", prompt_len=5))
    with pytest.raises(ValueError, match="already in use"):
        core.add_request(make_request("ok", prompt_len=5))
    run_to_completion(core)


def test_dynamic_mode_admits_no_request_until_the_batch_finishes() -> None:
    clock = FakeClock()
    core, executor = make_core(num_blocks=128, clock=clock, batching="dynamic", max_num_seqs=4)
    for i in range(4):
        core.add_request(make_request(f"a{i}", prompt_len=4, max_tokens=2 + 6 * (i == 0), clock=clock))
    core.step()
    core.add_request(make_request("late", prompt_len=4, max_tokens=2, clock=clock))
    seen_late_with_batch = False
    while core.has_unfinished_requests():
        core.step()
        ids = {s.request_id for s in executor.plans[-1].scheduled}
        if "late" in ids and ids & {"a0", "a1", "a2", "a3"}:
            seen_late_with_batch = True
        check_step(core)
    assert not seen_late_with_batch


def test_static_mode_reserves_max_length_and_pads_finished_rows() -> None:
    clock = FakeClock()
    core, executor = make_core(num_blocks=128, clock=clock, batching="static", max_num_seqs=3)
    lengths = {"s0": 2, "s1": 9, "s2": 4}
    for rid, n in lengths.items():
        core.add_request(make_request(rid, prompt_len=5, max_tokens=n, clock=clock))
    first = {o.request_id: o.new_token_ids for o in core.step()}
    for rid, n in lengths.items():  # the whole max length is reserved at admission
        assert core.kv.num_allocated_blocks(rid) == -(-(5 + n) // 4)
    core.add_request(make_request("late", prompt_len=5, max_tokens=2, clock=clock))
    outputs = run_to_completion(core)
    for rid, tokens in first.items():
        outputs[rid] = tokens + outputs[rid]
    assert {rid: len(outputs[rid]) for rid in lengths} == lengths
    rows_per_step = [len(p.scheduled) for p in executor.plans[1:9]]
    assert rows_per_step == [3] * 8  # finished rows keep costing compute until the longest ends
    assert sum(1 for p in executor.plans for s in p.scheduled if s.padding) == (9 - 2) + (9 - 4)
    late_steps = [i for i, p in enumerate(executor.plans) if any(s.request_id == "late" for s in p.scheduled)]
    last_batch_step = max(i for i, p in enumerate(executor.plans) if any(s.request_id == "s1" for s in p.scheduled))
    assert min(late_steps) > last_batch_step
    assert core.kv.num_free_blocks == core.kv.num_blocks
