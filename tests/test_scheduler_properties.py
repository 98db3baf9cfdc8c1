"""Property-based test: random workloads, budgets, pool sizes and modes keep every invariant, finish every
request with the output it would produce alone, and leak no block."""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.fakes import FakeClock, FakeExecutor, OracleProposer, check_step, make_core, make_request

request_strategy = st.fixed_dictionaries({
    "prompt_len": st.integers(1, 40),
    "max_tokens": st.integers(1, 16),
    "arrive_step": st.integers(0, 30),
    "shared_prefix": st.booleans(),
    "priority": st.integers(0, 3),
    "eos_at": st.one_of(st.none(), st.integers(0, 15)),
    "abort_step": st.one_of(st.none(), st.integers(0, 60)),
})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(request_strategy, min_size=1, max_size=14),
    block_size=st.sampled_from([1, 2, 4, 8]),
    num_blocks=st.one_of(st.integers(4, 24), st.integers(24, 80)),
    budget=st.integers(1, 64),
    max_num_seqs=st.integers(1, 6),
    partial=st.integers(1, 3),
    batching=st.sampled_from(["continuous", "continuous", "dynamic", "static"]),
    policy=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
    spec_k=st.sampled_from([0, 0, 1, 3, 5]),
    target_itl_ms=st.sampled_from([None, None, 5.0, 50.0]),  # with a target: prompts shortest first, within the bound
)
def test_random_workloads_keep_invariants(requests, block_size, num_blocks, budget, max_num_seqs, partial,  # noqa: ANN001
                                          batching, policy, caching, spec_k, target_itl_ms) -> None:
    clock = FakeClock()
    eos_at = {f"r{i}": r["eos_at"] for i, r in enumerate(requests) if r["eos_at"] is not None}
    executor = FakeExecutor(num_blocks, clock, eos_at=eos_at)
    core, _ = make_core(clock=clock, executor=executor, block_size=block_size, max_num_batched_tokens=budget,
                        max_num_seqs=max_num_seqs, max_num_partial_prefills=partial, batching=batching,
                        policy=policy, enable_prefix_caching=caching, max_model_len=64,
                        target_itl_ms=target_itl_ms)
    if spec_k:  # speculative decoding: proposals partly right, verified, rolled back; outputs must not change
        core.proposer = OracleProposer(spec_k, executor)  # type: ignore[assignment]
    capacity = num_blocks * block_size
    prefix = list(range(500, 520))
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    accepted: dict[str, dict] = {}
    aborted: set[str] = set()
    step = 0
    while step < 3000:
        for i, r in enumerate(requests):
            if r["arrive_step"] == step:
                rid = f"r{i}"
                req = make_request(rid, r["prompt_len"], r["max_tokens"], clock, r["priority"],
                                   prefix if r["shared_prefix"] else None)
                too_big = req.num_prompt_tokens >= min(64, capacity) or (
                    batching == "static" and req.num_prompt_tokens + r["max_tokens"] > capacity)
                try:
                    core.add_request(req)
                    assert not too_big
                    accepted[rid] = r
                except ValueError:
                    assert too_big
            rid = f"r{i}"
            if (r["abort_step"] == step and rid in accepted and rid not in finish
                    and core.abort_requests([rid])):
                aborted.add(rid)
        for out in core.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason:
                finish[out.request_id] = out.finish_reason
        check_step(core)
        step += 1
        if step > 31 and not core.has_unfinished_requests():
            break
    event(f"preempted: {core.scheduler.total_preemptions > 0}")
    event(f"prefix hits: {core.kv.prefix_hits > 0}")
    event(f"speculated: {any(s.num_spec_tokens for p in executor.plans for s in p.scheduled)}")
    assert not core.has_unfinished_requests(), "requests did not finish"
    assert core.kv.num_free_blocks == core.kv.num_blocks
    assert not core.kv.req_blocks
    core.kv.check_integrity()
    for rid, r in accepted.items():
        if rid in aborted:
            continue
        assert rid in finish, rid
        got = outputs[rid]
        prompt_len = r["prompt_len"] + (20 if r["shared_prefix"] else 0)
        limit = min(r["max_tokens"], min(64, capacity) - prompt_len)
        if r["eos_at"] is not None and r["eos_at"] < limit:
            assert len(got) == r["eos_at"] + 1 and finish[rid] == "stop"
        else:
            assert len(got) == limit and finish[rid] == "length"
        # the fake model is a function of (request, position): preemption and chunking change nothing
        alone, _ = make_core(num_blocks=num_blocks, block_size=block_size, max_model_len=64,
                             executor=FakeExecutor(num_blocks, eos_at=eos_at))
        alone.add_request(make_request(rid, r["prompt_len"], r["max_tokens"], None, 0,
                                       prefix if r["shared_prefix"] else None))
        solo: list[int] = []
        while alone.has_unfinished_requests():
            for out in alone.step():
                solo.extend(out.new_token_ids)
        assert got == solo
