"""The drift monitor (`--drift-probe FILE`): fixed prompts run greedily through the live engine every
`--drift-probe-interval` minutes, at the lowest priority, through the scheduler like any request; their tokens
and logprobs are compared with the answers recorded at start. The engine is batch invariant (a prompt's greedy
tokens are the same alone or in any batch; its logprobs within float rounding: 1e-5 on the float32 path, where a
GEMM of another batch size sums in another order), so a changed token, or a logprob beyond
`--drift-logprob-tolerance`, is a real change: weights swapped or damaged, a kernel or the hardware misbehaving.
Metrics `tokenmill:drift_*` (the exact differences), and a warning line when it drifts."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from tokenmill.sampling_params import SamplingParams
from tokenmill.server.cache_salt import salted

if TYPE_CHECKING:
    from tokenmill.engine.async_engine import AsyncLLM

logger = logging.getLogger(__name__)

LOWEST_PRIORITY = 1_000_000  # lower runs first: probes wait behind every client request
DEFAULT_MAX_TOKENS = 16


@dataclass
class Probe:
    prompt: str | list[int]
    max_tokens: int = DEFAULT_MAX_TOKENS


@dataclass
class ProbeAnswer:
    tokens: list[int]
    logprobs: list[float]  # each chosen token's


@dataclass
class DriftReport:
    agreement: float  # share of the baseline's tokens reproduced (up to each probe's first difference)
    max_logprob_diff: float  # over the tokens both runs share
    changed: list[int]  # the probes whose answer differs


def load_probes(path: str) -> list[Probe]:
    """A JSON list, or JSON lines, of prompts: a string, token ids, or {"prompt": ..., "max_tokens": N}."""
    text = Path(path).read_text()
    try:
        items: list[Any] = json.loads(text)
        if not isinstance(items, list):
            items = [items]
    except ValueError:
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    probes = []
    for item in items:
        if isinstance(item, dict):
            probes.append(Probe(item["prompt"], int(item.get("max_tokens", DEFAULT_MAX_TOKENS))))
        else:
            probes.append(Probe(item))
    if not probes or any(not p.prompt or p.max_tokens < 1 for p in probes):
        raise ValueError(f"--drift-probe {path}: give one or more non-empty prompts with max_tokens >= 1")
    return probes


def compare(baseline: list[ProbeAnswer], current: list[ProbeAnswer], tolerance: float = 0.0) -> DriftReport:
    """`changed`: the probes with another token, or a logprob more than `tolerance` away."""
    matched = total = 0
    worst = 0.0
    changed = []
    for index, (before, now) in enumerate(zip(baseline, current)):
        same = 0
        while same < min(len(before.tokens), len(now.tokens)) and before.tokens[same] == now.tokens[same]:
            same += 1
        diff = max((abs(a - b) for a, b in zip(before.logprobs[:same], now.logprobs[:same])), default=0.0)
        worst = max(worst, diff)
        if same < len(before.tokens) or len(now.tokens) != len(before.tokens) or diff > tolerance:
            changed.append(index)
        matched += same
        total += len(before.tokens)
    return DriftReport(matched / max(total, 1), worst, changed)


class DriftMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]
        self.agreement = Gauge("tokenmill:drift_token_agreement", "Share of the drift probes' baseline tokens "
                               "reproduced at the last check (1: no drift)", labels, registry=registry)
        self.max_logprob_diff = Gauge("tokenmill:drift_max_logprob_diff", "Largest difference of a drift probe "
                                      "token's logprob from its baseline at the last check", labels, registry=registry)
        self.checks = Counter("tokenmill:drift_checks", "Drift probe runs compared with the baseline", labels,
                              registry=registry)
        self.drifted = Counter("tokenmill:drift_detected", "Drift probe runs that differed from the baseline",
                               labels, registry=registry)
        self.model_name = model_name
        for counter in (self.checks, self.drifted):
            counter.labels(model_name)  # a series at 0 from the start

    def record(self, report: DriftReport) -> None:
        self.agreement.labels(self.model_name).set(report.agreement)
        self.max_logprob_diff.labels(self.model_name).set(report.max_logprob_diff)
        self.checks.labels(self.model_name).inc()
        if report.changed:
            self.drifted.labels(self.model_name).inc()


async def probe_answers(llm: AsyncLLM, probes: list[Probe], tag: str) -> list[ProbeAnswer]:
    """Each probe's greedy answer from this engine, at the lowest priority. `tag` names the run: it is the
    requests' id prefix and their cache salt, so a prompt is computed whole every time, as at the baseline (a
    prefix-cache hit computes the last prompt token in a step of another shape, and float sums in another order
    move its logprobs by 1e-5 where the tokens stay the same)."""

    async def answer(index: int, probe: Probe) -> ProbeAnswer:
        params = SamplingParams(max_tokens=probe.max_tokens, temperature=0.0, logprobs=0)
        last = None
        async for output in llm.generate(f"{tag}-{index}", salted(probe.prompt, tag), params, LOWEST_PRIORITY):
            last = output
        assert last is not None
        completion = last.outputs[0]
        return ProbeAnswer(list(completion.token_ids),
                           [entry[token] for entry, token in zip(completion.logprobs or [], completion.token_ids)])

    return list(await asyncio.gather(*(answer(i, p) for i, p in enumerate(probes))))


class DriftMonitor:
    def __init__(self, llm: AsyncLLM, probes: list[Probe], interval_s: float, metrics: DriftMetrics,
                 tolerance: float = 0.0) -> None:
        self.llm = llm
        self.tolerance = tolerance
        self.probes = probes
        self.interval_s = interval_s
        self.metrics = metrics
        self._runs = itertools.count()
        self.baseline: list[ProbeAnswer] | None = None

    async def run_probes(self) -> list[ProbeAnswer]:
        return await probe_answers(self.llm, self.probes, f"tokenmill-drift-probe-{next(self._runs)}")

    async def check(self) -> DriftReport:
        """Run the probes; the first run is the baseline."""
        answers = await self.run_probes()
        if self.baseline is None:
            self.baseline = answers
            logger.info("drift monitor: baseline of %d probes recorded (%d tokens)", len(answers),
                        sum(len(a.tokens) for a in answers))
        report = compare(self.baseline, answers, self.tolerance)
        self.metrics.record(report)
        if report.changed:
            logger.warning("drift: probes %s differ from the baseline (token agreement %.3f, largest logprob "
                           "difference %.3g)", report.changed, report.agreement, report.max_logprob_diff)
        return report

    async def run_forever(self) -> None:
        while True:
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - an engine that cannot answer now is checked next time
                logger.warning("drift monitor: the probes did not run: %s", exc)
            await asyncio.sleep(self.interval_s)
