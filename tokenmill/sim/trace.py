"""Step traces: `tokenmill serve --step-trace FILE` writes one JSON line per engine step that ran the model (its
wall time and, per sequence, new tokens, tokens before them and rows sampled), and `tokenmill sim calibrate
--step-trace FILE` fits the serving overhead to them: the steps a real server took under real load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO

from tokenmill.engine.core import StepRecord
from tokenmill.sim.cost_model import StepShape


class StepTraceWriter:
    """A step listener (it runs on the server's event loop, off the engine thread); lines are flushed as
    written, so a trace can be read while the server runs."""

    def __init__(self, path: str | Path) -> None:
        self.file: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115 - open for the server's lifetime

    def on_step(self, record: StepRecord) -> None:
        if record.plan is None or record.plan.is_empty:
            return
        shape = StepShape.of(record.plan)
        self.file.write(json.dumps({"step": record.step, "seconds": round(record.seconds, 6),
                                    "sequences": shape.sequences}, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self.file.close()


def read_step_trace(path: str | Path, skip: int = 0) -> list[tuple[StepShape, float]]:
    """(shape, whole-step seconds) of each traced step, after the first `skip` lines."""
    steps = []
    with open(path) as f:
        for line in list(f)[skip:]:
            entry = json.loads(line)
            steps.append((StepShape(tuple(tuple(s) for s in entry["sequences"])), float(entry["seconds"])))
    return steps
