"""Chooses, after each step, the tokens each running request proposes for the next one: which requests
speculate and how many tokens (the adaptive part), then the n-gram lookup or the draft model fills them in.

How many: a proposed token is one more row of the next step. It pays when its chance of being accepted beats
what that row's time would yield without speculation. With a step costing T(rows) = a + b * rows and B requests
decoding, a row's time is worth b * B / (a + b * B) tokens of plain decoding: ~0.05 alone on this CPU (the step
streams the weights once whatever its rows), ~0.6 at 32 requests (every row is compute). A request whose tokens
are each accepted with probability alpha (its proposal's j-th token lands with alpha^j) proposes the longest k
whose last token still pays: alpha^k >= that break-even. The proposer fits a and b to the engine's own decode
steps and estimates each request's alpha from its recent verifications on top of a prior, the acceptance of all
recent verifications (a new request starts from what similar requests achieved). While a request does not
speculate its estimate drifts back to that prior, and every PROBE_INTERVAL such steps it proposes one token, so
the estimates keep learning when speculation stopped paying (a probe costs one row).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tokenmill.config import EngineConfig
from tokenmill.core.outputs import SchedulerOutput, SchedulerStats
from tokenmill.request import Request
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.ngram import propose_ngram

# b / a before the engine has timed steps of different sizes (measured here: ~0.05 with int8 linears on 2 cores)
PRIOR_ROW_COST_RATIO = 0.05
# A request's acceptance memory: each verification's weight decays by this factor per step
ACCEPTANCE_DECAY = 0.9
# The engine-wide acceptance (the requests' prior): each step's verifications decay by this per step (without
# verifications it drifts back to 0.5, so the probes resume after a poor phase)
POOL_DECAY = 0.98
PRIOR_WEIGHT = 2.0  # the prior counts as this many verifications in a request's estimate
PROBE_INTERVAL = 16  # steps without proposals after which a request proposes one token anyway
# A token is proposed only when its expected gain beats its cost by this factor: both are estimates, and near
# break-even an error costs throughput (a crowded batch loses what a wrong row costs; measured 0.95x at 32
# streams on the grounded workload without it)
COST_MARGIN = 1.25


class StepCostModel:
    """T(rows) = a + b * rows, fitted by exponentially weighted least squares to recent decode-only steps."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        d = self.decay
        self.n = d * self.n + 1.0
        self.sx = d * self.sx + rows
        self.sy = d * self.sy + seconds
        self.sxx = d * self.sxx + rows * rows
        self.sxy = d * self.sxy + rows * seconds

    def row_cost_ratio(self) -> float:
        """b / a: one row's share of a one-row step (the prior until steps of different sizes were seen)."""
        if self.n < 8:
            return PRIOR_ROW_COST_RATIO
        mean_x, mean_y = self.sx / self.n, self.sy / self.n
        variance = self.sxx / self.n - mean_x * mean_x
        if variance < 0.25:  # the rows barely varied: no slope to read
            return PRIOR_ROW_COST_RATIO
        b = (self.sxy / self.n - mean_x * mean_y) / variance
        a = mean_y - b * mean_x
        if a <= 0.0 or b <= 0.0:
            return PRIOR_ROW_COST_RATIO
        return min(1.0, max(1e-3, b / a))

    def break_even(self, batch: int) -> float:
        """The acceptance probability at which one more row pays with `batch` requests decoding (with the margin
        for estimation errors)."""
        rows = self.row_cost_ratio() * max(1, batch)
        return min(1.0, COST_MARGIN * rows / (1.0 + rows))


def record_verification(request: Request, num_proposed: int, num_accepted: int) -> None:
    request.spec_accepted = ACCEPTANCE_DECAY * request.spec_accepted + num_accepted
    request.spec_rejections = ACCEPTANCE_DECAY * request.spec_rejections + (num_accepted < num_proposed)


def proposal_length(alpha: float, break_even: float, max_tokens: int) -> int:
    """The longest k <= max_tokens with alpha^k >= break_even (0 when not even one token pays)."""
    if alpha <= break_even:
        return 0
    if alpha >= 1.0 or break_even <= 0.0:
        return max_tokens
    return min(max_tokens, int(math.log(break_even) / math.log(alpha)))


class Proposer:
    def __init__(self, config: SpeculativeConfig, engine: EngineConfig, num_kv_blocks: int) -> None:
        self.config = config
        self.cost = StepCostModel()
        self.pool_accepted = self.pool_rejections = 0.0  # all requests' recent verifications
        self.draft = None
        if config.method == "draft_model":
            from tokenmill.spec_decode.draft_model import DraftModelProposer

            self.draft = DraftModelProposer(config, engine, num_kv_blocks)

    def observe_step(self, plan: SchedulerOutput, seconds: float, stats: SchedulerStats) -> None:
        """Learn from a finished step: its cost if it only decoded (prompt chunks would dominate the fit), and
        its verifications."""
        if plan.scheduled and all(s.num_tokens == 1 + s.num_spec_tokens for s in plan.scheduled):
            self.cost.observe(sum(s.num_tokens for s in plan.scheduled), seconds)
        self.pool_accepted = POOL_DECAY * self.pool_accepted + stats.spec_num_accepted_tokens
        self.pool_rejections = POOL_DECAY * self.pool_rejections + stats.spec_num_rejections

    def acceptance(self, request: Request) -> float:
        """The request's per-token acceptance estimate: accepted tokens / (accepted tokens + rejections), its own
        recent ones on top of the engine-wide estimate (0.5 before any verification)."""
        prior = (self.pool_accepted + 1.0) / (self.pool_accepted + self.pool_rejections + 2.0)
        return ((request.spec_accepted + PRIOR_WEIGHT * prior)
                / (request.spec_accepted + request.spec_rejections + PRIOR_WEIGHT))

    def propose(self, running: Sequence[Request]) -> None:
        """Set `spec_token_ids` of every running request for the next step (empty when it should not speculate)."""
        config = self.config
        crowded = config.disable_by_batch_size is not None and len(running) >= config.disable_by_batch_size
        break_even = max(config.min_acceptance_rate, self.cost.break_even(len(running)))
        eligible: list[Request] = []
        ks: list[int] = []
        for request in running:
            request.spec_token_ids = []
            if crowded or request.num_computed_tokens != request.num_tokens - 1:  # prefilling, or crowded
                continue
            # a step emits accepted proposals + 1 token: never propose past the request's length limit
            limit = min(config.num_speculative_tokens, request.max_total_tokens - request.num_tokens - 1)
            alpha = self.acceptance(request)
            k = proposal_length(alpha, break_even, limit)
            if k == 0:  # no evidence this step: the estimate drifts back towards the prior
                record_verification(request, 0, 0)
                request.spec_idle_steps += 1
                if request.spec_idle_steps >= PROBE_INTERVAL and alpha >= config.min_acceptance_rate and limit > 0:
                    k = 1
            if k > 0:
                request.spec_idle_steps = 0
                eligible.append(request)
                ks.append(k)
        if self.draft is not None:
            self.draft.propose(running, eligible, ks)
            return
        for request, k in zip(eligible, ks):
            request.spec_token_ids = propose_ngram(request.all_token_ids, k, config.prompt_lookup_min,
                                                   config.prompt_lookup_max)
