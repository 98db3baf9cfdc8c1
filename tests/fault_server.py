"""`tokenmill serve` with two faults injected, for the fault-isolation tests (a real server process, real model).

- A prompt holding POISON_STEP makes the model step raise, after writing wrong KV (token 0 everywhere) into the
  slots of every request in that step, so that a prefix cache that kept those blocks would serve garbage.
- A prompt holding POISON_FATAL makes the scheduler's update raise: the engine's state can no longer be
  trusted, so the engine loop must die and the process exit non-zero.
- A prompt holding POISON_GRAMMAR has its first sampled token replaced by POISON_GRAMMAR itself, past the
  grammar's mask (what a kernel or hardware fault would do): a constrained request then breaks its grammar.

Run as `python -m tests.fault_server serve [flags]`.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from tokenmill.cli import main
from tokenmill.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.executor.model_runner import ModelRunner

POISON_STEP = 49100
POISON_FATAL = 49101
POISON_GRAMMAR = 49102

_execute = ModelRunner.execute
_update = Scheduler.update


def _has(plan: SchedulerOutput, token: int) -> bool:
    return any(token in s.prompt_token_ids for s in plan.scheduled)


def faulty_execute(self: ModelRunner, plan: SchedulerOutput) -> ModelRunnerOutput:
    if _has(plan, POISON_STEP):
        _execute(self, replace(plan, scheduled=[replace(s, token_ids=[0] * len(s.token_ids)) for s in plan.scheduled]))
        raise RuntimeError("injected fault in the model step")
    output = _execute(self, plan)
    for s in plan.scheduled:
        if POISON_GRAMMAR in s.prompt_token_ids and s.request_id in output.sampled_token_ids:
            output.sampled_token_ids[s.request_id] = POISON_GRAMMAR
    return output


def faulty_update(self: Scheduler, plan: SchedulerOutput, output: ModelRunnerOutput) -> list[EngineCoreOutput]:
    if _has(plan, POISON_FATAL):
        raise RuntimeError("injected fault in the scheduler")
    return _update(self, plan, output)


ModelRunner.execute = faulty_execute  # type: ignore[method-assign]
Scheduler.update = faulty_update  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
