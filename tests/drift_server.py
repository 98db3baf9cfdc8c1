"""`tokenmill serve` whose weights change while it runs, for the drift monitor's test: once the file named by
TOKENMILL_TEST_PERTURB exists, the next model step scales the final norm's weights by 1.05 (a weight swapped or
damaged in memory). Run as `python -m tests.drift_server serve [flags]`."""

from __future__ import annotations

import os
import sys

import torch

from tokenmill.cli import main
from tokenmill.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenmill.executor.model_runner import ModelRunner

_execute = ModelRunner.execute


def perturbing_execute(self: ModelRunner, plan: SchedulerOutput) -> ModelRunnerOutput:
    trigger = os.environ.get("TOKENMILL_TEST_PERTURB")
    if trigger and os.path.exists(trigger) and not getattr(self, "perturbed", False):
        with torch.no_grad():
            self.model.norm.weight.mul_(1.05)
        self.perturbed = True
    return _execute(self, plan)


ModelRunner.execute = perturbing_execute  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
