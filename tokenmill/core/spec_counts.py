"""Speculative decoding's bookkeeping in the scheduler: what each verification accepted, counted for the step's
stats, the engine's totals, and the request's own record (from which the proposer sizes its next proposal)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.core.outputs import SchedulerStats
from tokenmill.request import Request
from tokenmill.spec_decode.proposer import record_verification


@dataclass
class SpecDecodeCounts:
    drafts: int = 0  # verified proposals
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def record(self, request: Request, num_proposed: int, num_accepted: int, stats: SchedulerStats) -> None:
        self.drafts += 1
        self.draft_tokens += num_proposed
        self.accepted_tokens += num_accepted
        stats.spec_num_drafts += 1
        stats.spec_num_draft_tokens += num_proposed
        stats.spec_num_accepted_tokens += num_accepted
        stats.spec_num_rejections += num_accepted < num_proposed
        if len(stats.spec_accepted_per_pos) < num_proposed:
            stats.spec_accepted_per_pos.extend([0] * (num_proposed - len(stats.spec_accepted_per_pos)))
        for pos in range(num_accepted):
            stats.spec_accepted_per_pos[pos] += 1
        record_verification(request, num_proposed, num_accepted)
