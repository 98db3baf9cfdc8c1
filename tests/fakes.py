"""A fake executor (no model) and a fake clock for scheduler tests."""

from __future__ import annotations

import zlib

from tokenmill.config import EngineConfig
from tokenmill.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenmill.engine.core import EngineCore
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.sim.executor import SimClock as FakeClock  # time moves only when a test moves it

EOS = 2


class FakeExecutor:
    """Returns a deterministic token per (request, position); records every plan it ran."""

    def __init__(self, num_kv_blocks: int, clock: FakeClock | None = None, step_seconds: float = 0.01,
                 eos_at: dict[str, int] | None = None) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.clock = clock
        self.step_seconds = step_seconds
        self.eos_at = eos_at or {}  # request id -> output index at which EOS is produced
        self.plans: list[SchedulerOutput] = []

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        self.plans.append(plan)
        if self.clock is not None:
            self.clock.now += self.step_seconds
        out = ModelRunnerOutput({})
        for s in plan.scheduled:
            if not s.sample or s.padding:
                continue
            # verify proposals as a model would: accept while they equal the true tokens, then one true token
            first = s.start_position + s.num_tokens - s.num_spec_tokens  # position of the first new token
            proposed = s.token_ids[len(s.token_ids) - s.num_spec_tokens:]
            emitted = []
            for j in range(s.num_spec_tokens + 1):
                true = self.token(s.request_id, first + j, len(s.output_token_ids) + j)
                emitted.append(true)
                if j == s.num_spec_tokens or proposed[j] != true:
                    break
            out.sampled_token_ids[s.request_id] = emitted[-1]
            if len(emitted) > 1:
                out.accepted_token_ids[s.request_id] = emitted[:-1]
        return out

    def token(self, request_id: str, position: int, output_index: int) -> int:
        """The fake model's token at `position` (the `output_index`-th output token)."""
        if self.eos_at.get(request_id) == output_index:
            return EOS
        return 10 + (zlib.crc32(request_id.encode()) + position) % 1000


class OracleProposer:
    """Proposes k tokens of which a pseudo-random number (0..k) are right: exercises acceptance, rejection and
    rollback in the scheduler without a model."""

    def __init__(self, k: int, executor: FakeExecutor) -> None:
        self.k = k
        self.executor = executor

    def observe_step(self, plan: object, seconds: float, stats: object) -> None:
        """Proposes the same whatever the steps cost."""

    def propose(self, running: list[Request]) -> None:
        for r in running:
            r.spec_token_ids = []
            if r.num_computed_tokens != r.num_tokens - 1:
                continue
            k = min(self.k, r.max_total_tokens - r.num_tokens - 1)
            right = zlib.crc32(f"{r.request_id}:{r.num_tokens}".encode()) % (self.k + 1)
            for j in range(max(0, k)):
                true = self.executor.token(r.request_id, r.num_tokens + j, r.num_output_tokens + j)
                r.spec_token_ids.append(true if j < right else true + 1)


def make_core(num_blocks: int = 64, clock: FakeClock | None = None, max_model_len: int = 4096,
              executor: FakeExecutor | None = None, **config: object) -> tuple[EngineCore, FakeExecutor]:
    clock = clock or FakeClock()
    executor = executor or FakeExecutor(num_blocks, clock)
    config.setdefault("block_size", 4)
    core = EngineCore(EngineConfig(**config), executor, max_model_len, clock)  # type: ignore[arg-type]
    return core, executor


def make_request(request_id: str, prompt_len: int, max_tokens: int = 8, clock: FakeClock | None = None,
                 priority: int = 0, prefix: list[int] | None = None, **params: object) -> Request:
    prompt = (prefix or []) + [100 + (i * 7 + len(request_id)) % 500 for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),  # type: ignore[arg-type]
                   (EOS,), arrival_time=clock() if clock else 0.0, priority=priority)


def run_to_completion(core: EngineCore, max_steps: int = 10_000, check: bool = True) -> dict[str, list[int]]:
    """Step until idle; check invariants after every step; return every request's output tokens."""
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if check:
            check_step(core)
    else:
        raise AssertionError("requests did not finish")
    return outputs


def check_step(core: EngineCore) -> None:
    """The invariants every step must keep."""
    scheduler = core.scheduler
    config = core.config
    scheduler.check_integrity()
    plan = core.executor.plans[-1] if core.executor.plans else None  # type: ignore[attr-defined]
    if plan is not None:
        real = [s for s in plan.scheduled if not s.padding]
        assert sum(s.num_tokens for s in real) <= config.max_num_batched_tokens
        assert len(plan.scheduled) <= config.max_num_seqs
        assert len({s.request_id for s in plan.scheduled}) == len(plan.scheduled)
        for s in plan.scheduled:
            needed = -(-(s.start_position + s.num_tokens) // config.block_size)
            assert len(s.block_table) >= needed
    assert len(scheduler.running) <= config.max_num_seqs
    for request in scheduler.running:  # only known (accepted) tokens are ever hashed into the prefix cache
        for i, block in enumerate(core.kv.req_blocks.get(request.request_id, [])):
            if block.block_hash is not None:
                bs = config.block_size
                assert block.token_ids == tuple(request.all_token_ids[i * bs:(i + 1) * bs])
