"""Shortest remaining prompt first, within a bound on what policy order owes every prompt (`--target-itl-ms`).

The prompts of a step are offered the chunk budget in policy order (FCFS or priority: running prompts first,
then the waiting queue). A later prompt with fewer tokens left may go ahead of earlier ones, so a short prompt
is not held behind a long one for the long one's whole prefill. The bound: the prompt tokens computed for later
prompts ahead of a prompt, over its whole wait, total at most `bound_tokens` (one full chunk,
max_num_batched_tokens): no prompt's first token is delayed by more than one chunk's time by later arrivals.
A pass is allowed only when the passing prompt's whole remaining prompt fits in what every prompt it passes
has left of that allowance.
"""

from __future__ import annotations

from tokenmill.request import Request

# Only the first prompts in policy order are reordered (the order is rebuilt each step; the rest keep theirs).
WINDOW = 16


def remaining_prompt(request: Request) -> int:
    return max(request.num_tokens - request.num_computed_tokens, 0)


class ShortestPromptFirst:
    def __init__(self, bound_tokens: int) -> None:
        self.bound_tokens = bound_tokens
        # request id -> prompt tokens computed for later prompts that went ahead of it (while it still waits)
        self.overtaken: dict[str, int] = {}

    def order(self, candidates: list[Request]) -> list[Request]:
        """`candidates` in policy order -> the order in which they are offered this step's budget."""
        head, tail = candidates[:WINDOW], candidates[WINDOW:]
        self.overtaken = {r.request_id: self.overtaken.get(r.request_id, 0) for r in candidates}
        pending = list(head)
        owed = dict(self.overtaken)  # counting this step's passes too, each at its whole remaining prompt
        ordered: list[Request] = []
        while pending:
            # the prompt at position i may go first only if every prompt before it can still be passed by it
            pick, allowance = 0, self.bound_tokens
            for i, request in enumerate(pending):
                need = remaining_prompt(request)
                if i > 0 and need <= allowance and need < remaining_prompt(pending[pick]):
                    pick = i
                allowance = min(allowance, self.bound_tokens - owed[request.request_id])
            for passed in pending[:pick]:
                owed[passed.request_id] += remaining_prompt(pending[pick])
            ordered.append(pending.pop(pick))
        return ordered + tail

    def charge(self, candidates: list[Request], ordered: list[Request], num_scheduled: dict[str, int]) -> None:
        """After the step's plan: every prompt passed by a scheduled later one is owed the tokens it got."""
        rank = {r.request_id: i for i, r in enumerate(candidates)}
        for position, request in enumerate(ordered):
            tokens = num_scheduled.get(request.request_id, 0)
            if not tokens:
                continue
            for passed in ordered[position + 1:]:
                if rank[passed.request_id] < rank[request.request_id]:
                    self.overtaken[passed.request_id] += tokens
