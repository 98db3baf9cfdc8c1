"""The loop that drives one engine core, wherever it runs (a thread of the API server, or its own process); the
messages it exchanges with the front end are in `engine/core_messages.py`.

Commands come in between steps (add, abort, finish-by-stop-string); after every batch of commands and every
step the loop publishes a `CoreReport`: the step's outputs and stats, the queue state, the load a router
balances on, the prefix cache's KV events and which command it has applied last. The front end never touches
the core's state; everything it learns is in the reports.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from tokenmill.core.outputs import EngineCoreOutput, StepRecord
from tokenmill.engine.core import EngineCore, ModelStepError
from tokenmill.engine.core_messages import Command, CoreDeath, CoreReport, RequestSync
from tokenmill.request import Request, RequestStatus

logger = logging.getLogger("tokenmill.engine")

# After this many model steps in a row have raised, the executor is taken to be broken: the core dies.
MAX_CONSECUTIVE_STEP_FAILURES = 3


class CoreLoop:
    """Runs a core: `receive(block)` returns the commands that arrived (waiting for some when `block`), or None
    to stop; `publish` sends each report (and a `CoreDeath` if the loop dies)."""

    def __init__(self, core: EngineCore, publish: Callable[[CoreReport | CoreDeath], None],
                 mirror_requests: bool = False, send_plans: bool = True, kv_events: bool = False) -> None:
        self.core = core
        self.publish = publish
        self.mirror_requests = mirror_requests  # the front end holds copies of the requests: send syncs
        self.send_plans = send_plans  # step records carry their plan (step traces need it)
        self.acked = 0
        # mirrored requests, with the token times and prefill chunks already sent
        self._tracked: dict[str, tuple[Request, int, int]] = {}
        if kv_events:  # a restarted engine's disk tier already holds prefixes: say so first
            core.kv.pool.events = [("stored", block_hash) for block_hash in core.held_prefix_blocks()]

    def run(self, receive: Callable[[bool], list[Command] | None]) -> None:
        core = self.core
        failures_in_a_row = 0
        try:
            if core.kv.pool.events:  # the prefixes a restart found on disk, before the first request is routed
                self._report([], None)
            while True:
                commands = receive(not core.has_unfinished_requests())
                if commands is None:
                    core.close()
                    return
                if commands:
                    self._report([], None, rejected=self._apply(commands))
                if not core.has_unfinished_requests():
                    continue
                try:
                    outputs = core.step()
                except ModelStepError as exc:
                    # Fault isolation: only the requests of this step fail; the rest keep their state and KV.
                    failures_in_a_row += 1
                    failed = core.fail_step(exc.plan)
                    logger.error("model step failed (%d in a row); failing its %d requests: %s",
                                 failures_in_a_row, len(failed), ", ".join(failed), exc_info=exc.__cause__)
                    self._untrack(failed)
                    self._report([], None, failed=failed,
                                 error=f"internal error in the model step: {exc.__cause__!r}")
                    if failures_in_a_row >= MAX_CONSECUTIVE_STEP_FAILURES:
                        raise RuntimeError(f"{failures_in_a_row} model steps in a row failed") from exc.__cause__
                    continue
                failures_in_a_row = 0
                self._report(outputs, core.last_step)
        except Exception as exc:  # the scheduler's state can no longer be trusted: stop, and say so
            logger.critical("engine loop died: %r", exc, exc_info=exc)
            with contextlib.suppress(Exception):
                core.abort_requests(list(core.scheduler.requests))
            self.publish(CoreDeath(repr(exc)))

    def _apply(self, commands: list[Command]) -> list[tuple[str, str]]:
        core = self.core
        rejected: list[tuple[str, str]] = []
        for seq, kind, payload in commands:
            if kind == "add":
                for child in payload:
                    try:
                        core.add_request(child)
                    except ValueError as exc:  # checked before sending; only a race could get here
                        rejected.append((child.request_id, str(exc)))
                        continue
                    if self.mirror_requests:
                        self._tracked[child.request_id] = (child, 0, 0)
            elif kind == "abort":
                core.abort_requests(payload)
                self._untrack(payload)
            elif kind == "finish":
                core.finish_requests(payload, RequestStatus.FINISHED_STOPPED)
                self._untrack(payload)
            elif kind == "release":
                core.release_kv(payload)
            self.acked = max(self.acked, seq)
        return rejected

    def _report(self, outputs: list[EngineCoreOutput], record: StepRecord | None, failed: list[str] | None = None,
                error: str | None = None, rejected: list[tuple[str, str]] | None = None) -> None:
        core = self.core
        running, waiting, kv_usage = core.current_state()
        events = core.kv.pool.events
        if events:
            core.kv.pool.events = []
        if record is not None and not self.send_plans:
            record = StepRecord(record.step, record.seconds, record.stats, None, record.started)
        remote_kv = core.scheduler.remote_kv
        kv_loaded: list[tuple[str, int, float]] = []
        kv_failed: list[str] = []
        if remote_kv is not None:
            load_failures, remote_kv.failures = remote_kv.failures, []
            if load_failures:  # a consumer could not fetch these requests' KV (they were aborted here)
                kv_failed = [request_id for request_id, _ in load_failures]
                self._untrack(kv_failed)
                logger.warning("KV transfer failed for %d requests: %s", len(load_failures), load_failures[0][1])
            kv_loaded, remote_kv.loaded = remote_kv.loaded, []
        self.publish(CoreReport(
            outputs, record, running, waiting, kv_usage, core.load_tokens(), self.acked, events or [],
            self._syncs(outputs) if self.mirror_requests else [], failed or [], error,
            [request_id for request_id, _ in rejected or []], rejected[0][1] if rejected else None,
            kv_loaded, core.connector.pending() if core.connector is not None else 0,
            kv_failed,
        ))

    def _untrack(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._tracked.pop(request_id, None)

    def _syncs(self, outputs: list[EngineCoreOutput]) -> list[RequestSync]:
        syncs = []
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            request, sent, sent_chunks = tracked
            times = request.times
            syncs.append(RequestSync(out.request_id, times.first_scheduled, times.first_token, times.last_token,
                                     times.finished, times.token_times[sent:], request.num_cached_tokens,
                                     request.num_preemptions, request.num_recomputed_tokens,
                                     times.prefill_chunks[sent_chunks:]))
            if request.is_finished:
                del self._tracked[out.request_id]
            else:
                self._tracked[out.request_id] = (request, len(times.token_times), len(times.prefill_chunks))
        return syncs
