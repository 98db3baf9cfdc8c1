"""A fake executor (no model) and a fake clock for scheduler tests."""

from __future__ import annotations

import zlib

from tokenmill.config import EngineConfig
from tokenmill.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenmill.engine.core import EngineCore
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams

EOS = 2


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


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
        tokens = {}
        for s in plan.scheduled:
            if s.sample and not s.padding:
                position = s.start_position + s.num_tokens
                if self.eos_at.get(s.request_id) == len(s.output_token_ids):
                    tokens[s.request_id] = EOS
                else:
                    tokens[s.request_id] = 10 + (zlib.crc32(s.request_id.encode()) + position) % 1000
        return ModelRunnerOutput(tokens)


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
