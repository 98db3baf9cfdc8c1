"""Step traces: `tokenmill serve --step-trace FILE` writes one JSON line per engine step that ran the model (when
it started, how long it took, whether requests were left, and per sequence: new tokens, tokens before them, rows
sampled), and `tokenmill sim calibrate --step-trace FILE` fits the time around the model to them: the steps a
real server took under real load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO

from tokenmill.core.outputs import StepRecord
from tokenmill.sim.cost_model import StepShape


class StepTraceWriter:
    """A step listener (it runs on the server's event loop, off the engine thread); lines are flushed as
    written, so a trace can be read while the server runs."""

    def __init__(self, path: str | Path) -> None:
        self.file: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115 - open for the server's lifetime

    def on_step(self, record: StepRecord, replica: int = 0) -> None:
        if record.plan is None or record.plan.is_empty:
            return
        shape = StepShape.of(record.plan)
        busy = record.stats.num_running + record.stats.num_waiting > 0
        self.file.write(json.dumps({"replica": replica, "step": record.step, "start": round(record.started, 6),
                                    "seconds": round(record.seconds, 6), "busy_after": busy,
                                    "sequences": shape.sequences}, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self.file.close()


def read_step_trace(path: str | Path, skip: int = 0) -> list[tuple[StepShape, float]]:
    """(shape, seconds) of each traced step after the first `skip` lines. The seconds are from the step's start
    to the next one's while the engine stayed busy: what the engine does between steps (handing outputs to the
    event loop, taking in new requests, waiting for the interpreter lock) is part of what each step costs; the
    step's own time where the engine went idle after it, or for the last step."""
    with open(path) as f:
        entries = [json.loads(line) for line in list(f)[skip:]]
    steps = []
    for entry, following in zip(entries, [*entries[1:], None]):
        seconds = float(entry["seconds"])
        if following is not None and entry.get("busy_after") and following["step"] == entry["step"] + 1:
            seconds = float(following["start"]) - float(entry["start"])
        steps.append((StepShape(tuple(tuple(s) for s in entry["sequences"])), seconds))
    return steps
