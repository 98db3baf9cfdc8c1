"""The token budget that sets itself (`--target-itl-ms`): while requests decode, prompt chunks get only as many
tokens as keep the step's predicted time within the target; with nothing decoding, prompts get the whole
`max_num_batched_tokens` (measured here: one 3,000-token step took 6% longer than 512-token chunks of the same
prompt, so "more" is not faster on this CPU).

Every step is held under the target, not the average: a credit scheme (steps under the target save time for a
later step, up to one target) was measured on `mixed` with a TPOT SLO equal to the target, and lost: with the
average at the target, about half the requests miss the SLO (goodput at 4 req/s 0.3 vs 1.28 req/s strict), and
the worst gap reached 2.3x the target.

The step-time predictor is fitted online on this engine's own steps, by exponentially weighted least squares on
what a step computes: t = a + b * tokens + c * attention + d * sequences, where `attention` is the context
every new token attends to (a chunk of n tokens after s computed ones attends n * (s + n / 2)). Decode rows and
prompt rows cost the same in the linear layers, so decode-only steps of different batch sizes already fit `b`.

A least-squares fit is right on average, so a chunk sized to the bare prediction runs over the target in about
half the steps (measured: target-50 steps had a median of 50.5 ms). The budget therefore keeps a margin: the
target is divided by the 90th percentile of observed / predicted time over the recent steps that mixed decodes
with a prompt chunk, so about nine steps in ten stay within it on a machine as noisy as the one it runs on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

import numpy as np

from tokenmill.core.outputs import SchedulerOutput

# Steps seen before the predictor is trusted; until then the fixed budget applies (today's behaviour).
MIN_OBSERVATIONS = 8
WARMUP_STEPS = 3  # an engine's first steps pay one-time costs (first touches of memory, lazy set-up): not fitted
# Once fitted, a step is learned from as at most this many times its prediction: one stall (a page fault storm,
# another process) cannot make the next hundred chunks tiny, while a real slowdown is still followed, doubling
# per step.
MAX_SURPRISE = 2.0
RIDGE = 1e-9  # keeps the normal equations solvable while a feature has not varied yet
MIN_PROMPT_TOKENS = 16  # prompts always progress, even when the decodes alone fill the target
MARGIN_WINDOW = 64  # the recent mixed steps (decodes and a prompt chunk) whose surprise sets the margin
MARGIN_QUANTILE = 0.9  # the share of steps meant to stay within the target
MIN_MARGIN_STEPS = 8  # mixed steps seen before the margin applies


def step_features(chunks: Iterable[tuple[int, int]]) -> np.ndarray:
    """[1, tokens, attention, sequences] of a step of (new tokens, tokens before them) per sequence."""
    tokens = attention = 0.0
    sequences = 0
    for new, before in chunks:
        tokens += new
        attention += new * (before + new / 2)
        sequences += 1
    return np.array([1.0, tokens, attention / 1e3, sequences])


class StepTimePredictor:
    def __init__(self, decay: float = 0.99) -> None:
        self.decay = decay
        self.xtx = np.zeros((4, 4))
        self.xty = np.zeros(4)
        self.observations = 0
        self.steps_seen = 0
        self.coefficients = np.zeros(4)
        self.last_error: float | None = None  # seconds, observed minus predicted, of the last step
        self.last_predicted: float | None = None  # seconds the last step was predicted to take (once ready)

    @property
    def ready(self) -> bool:
        return self.observations >= MIN_OBSERVATIONS

    def predict(self, features: np.ndarray) -> float:
        return float(features @ self.coefficients)

    def observe(self, plan: SchedulerOutput, seconds: float) -> None:
        if not plan.scheduled:
            return
        x = step_features((s.num_tokens, s.start_position) for s in plan.scheduled)
        self.steps_seen += 1
        if self.steps_seen <= WARMUP_STEPS:
            return
        self.last_predicted = self.predict(x) if self.ready else None
        self.last_error = None if self.last_predicted is None else seconds - self.last_predicted
        if self.last_predicted is not None:
            seconds = min(seconds, MAX_SURPRISE * max(self.last_predicted, 1e-6))
        self._fit(x, seconds)

    def _fit(self, x: np.ndarray, seconds: float) -> None:
        self.xtx = self.decay * self.xtx + np.outer(x, x)
        self.xty = self.decay * self.xty + x * seconds
        self.observations += 1
        solved = np.linalg.solve(self.xtx + RIDGE * np.eye(4), self.xty)
        # a cost never goes down with more work: a negative slope is noise (or collinearity) and is dropped
        self.coefficients = np.concatenate([solved[:1], np.maximum(solved[1:], 0.0)])

    def warm_start(self, seconds_of: Callable[[list[tuple[int, int]]], float], max_tokens: int) -> None:
        """Fit to a cost model's predictions (a calibrated profile's) over a grid of decode batches, prompt
        chunks and the two mixed, so the target applies from the first steps; real steps then take over."""
        for batch in (1, 4, 16, 64):
            for context in (32, 512, 2048):
                decodes = [(1, context)] * batch
                for chunk in (0, 16, max_tokens // 4, max_tokens):
                    chunks = decodes + ([(chunk, context)] if chunk else [])
                    self._fit(step_features(chunks), seconds_of(chunks))


class TokenBudget:
    """The prompt tokens of one step under `target_s`, given the decode work already in it."""

    def __init__(self, target_s: float, max_budget: int) -> None:
        self.target_s = target_s
        # max_num_batched_tokens: the budget with nothing decoding, until the predictor is fitted, and the cap
        self.max_budget = max_budget
        self.predictor = StepTimePredictor()
        self.last_prompt_budget: int | None = None
        self.surprises: deque[float] = deque(maxlen=MARGIN_WINDOW)  # observed / predicted, of mixed steps

    @property
    def margin(self) -> float:
        """How much longer than predicted a mixed step may run, nine times in ten (1 until enough are seen)."""
        if len(self.surprises) < MIN_MARGIN_STEPS:
            return 1.0
        return float(np.clip(np.quantile(list(self.surprises), MARGIN_QUANTILE), 1.0, MAX_SURPRISE))

    def warm_start(self, seconds_of: Callable[[list[tuple[int, int]]], float]) -> None:
        self.predictor.warm_start(seconds_of, self.max_budget)

    def prompt_tokens(self, decodes: list[tuple[int, int]], next_prompt_start: int) -> int:
        """How many prompt tokens may join `decodes` ((new tokens, tokens before) each), the chunk going to a
        prompt with `next_prompt_start` tokens computed."""
        if not decodes or not self.predictor.ready:
            budget = self.max_budget
        else:
            budget = self._largest_within_target(decodes, next_prompt_start)
        self.last_prompt_budget = budget
        return budget

    def _largest_within_target(self, decodes: list[tuple[int, int]], start: int) -> int:
        def predicted(tokens: int) -> float:
            chunks = decodes + ([(tokens, start)] if tokens else [])
            return self.predictor.predict(step_features(chunks))

        target = self.target_s / self.margin
        low, high = 0, self.max_budget
        if predicted(high) <= target:
            low = high
        while low < high:  # the largest n with predicted(n) <= target (the cost grows with n)
            mid = (low + high + 1) // 2
            if predicted(mid) <= target:
                low = mid
            else:
                high = mid - 1
        return max(low, MIN_PROMPT_TOKENS)

    def observe(self, plan: SchedulerOutput, seconds: float) -> bool:
        """Learn from a finished step; True when it had decodes running and ran over the target."""
        self.predictor.observe(plan, seconds)
        predicted = self.predictor.last_predicted
        if predicted and plan.num_decode_tokens and plan.num_prefill_tokens:
            self.surprises.append(seconds / predicted)
        return plan.num_decode_tokens > 0 and seconds > self.target_s
