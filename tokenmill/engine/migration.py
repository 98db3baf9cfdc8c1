"""Request migration: when an engine core dies, its unfinished requests continue on another one.

The front end's request table (the output processor) already holds what a request needs to resume: its prompt
token ids, sampling parameters and adapter, the tokens and logprobs its client has been sent, and the prompt
logprobs once they arrived; the detokenizer, stop strings and usage go on where they are, in the front end. A
resumed request is the original with those tokens appended as output: the new core computes prompt + output
again (reusing any prefix its cache holds), its grammar replays the output (core/grammar_waits.py), seeded
sampling draws from (seed, position) (executor/model_runner.py), and `max_tokens` counts the streamed tokens.
The kernels are batch-invariant, so a greedy request continues token for token as it would have.

A request is moved at most `limit` times (`--migration-limit`); one whose cores keep dying fails with the reason.
With no core up (one replica, restarting), resumed requests wait here until one is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.engine.output_processor import OutputProcessor, Progress
from tokenmill.request import Request

logger = logging.getLogger("tokenmill.engine")

# (engine request, replica it left, replica it went to or None while it waits for one)
MigrationListener = Callable[[str, int, int | None], None]


def resumed_request(progress: Progress) -> Request:
    """A fresh engine request that continues `progress` from its last streamed token."""
    original = progress.request
    resumed = Request(original.request_id, original.prompt_token_ids, original.sampling_params,
                      original.eos_token_ids, original.times.arrival, original.priority, original.prompt,
                      original.lora_request)
    for token in progress.token_ids:
        resumed.append_output_token(token)
    if progress.logprobs is not None:
        resumed.logprobs = list(progress.logprobs)
    if progress.prompt_logprobs is not None:  # already sent: the new core need not score the prompt again
        resumed.prompt_logprobs = [entry or {} for entry in progress.prompt_logprobs]
    resumed.cache_salt = original.cache_salt
    resumed.user_cache_salt = original.user_cache_salt
    resumed.num_preemptions = original.num_preemptions
    resumed.num_recomputed_tokens = original.num_recomputed_tokens
    return resumed


@dataclass
class HeldGroup:
    """Resumed requests of one client request waiting for a core to come up."""

    children: list[Request]
    source: int  # the replica they left
    colocated: bool  # disaggregated: they run on a decode engine, prompt included


class Migrations:
    """Which requests have moved how often, and the ones waiting for a core."""

    def __init__(self, output_processor: OutputProcessor, limit: int) -> None:
        self.output_processor = output_processor
        self.limit = limit
        self.moves: dict[str, int] = {}  # engine request -> times moved so far
        self.held: list[HeldGroup] = []
        self.listeners: list[MigrationListener] = []

    def take(self, child_ids: list[str]) -> tuple[dict[str, list[Request]], list[str]]:
        """Split a dead core's engine requests into resumed requests by client request (those still open and
        under the limit) and the ids that have used up their moves (the caller fails them)."""
        groups: dict[str, list[Request]] = {}
        exhausted: list[str] = []
        for child_id in child_ids:
            progress = self.output_processor.progress(child_id)
            if progress is None:
                continue  # finished or closed meanwhile: nothing to resume
            if self.moves.get(child_id, 0) >= self.limit:
                exhausted.append(child_id)
                continue
            groups.setdefault(progress.parent_id, []).append(resumed_request(progress))
        return groups, exhausted

    def moved(self, children: list[Request], source: int, target: int | None) -> None:
        """Count the move (once per request, also when it waits before going on) and tell the listeners."""
        for child in children:
            self.moves[child.request_id] = self.moves.get(child.request_id, 0) + 1
            progress = self.output_processor.progress(child.request_id)
            if progress is not None:  # the front end's copy, which the client's metrics and traces read
                progress.request.num_migrations += 1
            logger.warning("request %s moved from engine core %d to %s after %d tokens (move %d of at most %d)",
                           child.request_id, source, "the next core up" if target is None else f"engine core "
                           f"{target}", child.num_output_tokens, self.moves[child.request_id], self.limit)
            for listener in self.listeners:
                listener(child.request_id, source, target)

    def hold(self, group: HeldGroup) -> None:
        self.held.append(group)

    def release_held(self, can_place: Callable[[bool], bool]) -> list[HeldGroup]:
        """The held groups a core can take now (`can_place(colocated)`), with requests closed meanwhile
        dropped."""
        ready: list[HeldGroup] = []
        kept: list[HeldGroup] = []
        for group in self.held:
            group.children = [c for c in group.children if self.output_processor.progress(c.request_id) is not None]
            if not group.children:
                continue
            (ready if can_place(group.colocated) else kept).append(group)
        self.held = kept
        return ready

    def forget(self, child_ids: list[str]) -> None:
        for child_id in child_ids:
            self.moves.pop(child_id, None)
