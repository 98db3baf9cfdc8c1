"""The self-setting token budget (--target-itl-ms): the step-time predictor on synthetic step times, the
scheduler over an executor whose steps cost what a linear model says, and greedy outputs that do not depend on
the chunk sizes."""

from __future__ import annotations

import random

import pytest

from tests.fakes import FakeClock, FakeExecutor, make_core, make_request, run_to_completion
from tokenmill import LLM, SamplingParams
from tokenmill.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from tokenmill.core.token_budget import MIN_OBSERVATIONS, StepTimePredictor, TokenBudget, step_features
from tokenmill.sim import specs
from tokenmill.sim.cost_model import chunks_seconds

# The fake machine: a step costs 2 ms + 0.1 ms per token + 2 us per 1000 attended context + 0.05 ms per sequence.
A, B, C, D = 2e-3, 1e-4, 2e-6, 5e-5


def true_seconds(chunks: list[tuple[int, int]]) -> float:
    return float(step_features(chunks) @ [A, B, C, D])


def plan_of(chunks: list[tuple[int, int]]) -> SchedulerOutput:
    """A plan of one-token prompts: a row with tokens before it decodes, as the scheduler counts it."""
    scheduled = [ScheduledRequest(f"r{i}", [1] * new, before, [], True, SamplingParams(), [1], [])
                 for i, (new, before) in enumerate(chunks)]
    decode = sum(s.num_tokens for s in scheduled if s.start_position >= len(s.prompt_token_ids))
    return SchedulerOutput(scheduled, sum(s.num_tokens for s in scheduled) - decode, decode)


class CostedExecutor(FakeExecutor):
    """A fake executor whose steps take `true_seconds` of their shape on the fake clock."""

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        self.step_seconds = true_seconds([(s.num_tokens, s.start_position) for s in plan.scheduled])
        return super().execute(plan)


def test_predictor_converges_on_synthetic_steps() -> None:
    rng = random.Random(0)
    predictor = StepTimePredictor()
    for _ in range(200):
        chunks = [(1, rng.randint(10, 2000)) for _ in range(rng.randint(1, 16))]
        if rng.random() < 0.5:
            chunks.append((rng.randint(16, 512), rng.randint(0, 3000)))
        noise = rng.gauss(1.0, 0.02)
        predictor.observe(plan_of(chunks), true_seconds(chunks) * noise)
    for chunks in ([(1, 100)] * 8, [(1, 500)] * 4 + [(300, 1000)], [(512, 0)]):
        assert predictor.predict(step_features(chunks)) == pytest.approx(true_seconds(chunks), rel=0.05)


def test_a_step_over_the_target_shrinks_the_next_chunk() -> None:
    budget = TokenBudget(target_s=0.03, max_budget=4096)
    decodes = [(1, 200)] * 8
    for tokens in range(MIN_OBSERVATIONS + 4):  # learn a machine twice as fast as it is
        chunks = decodes + [(64 * (1 + tokens % 4), 0)]
        budget.predictor.observe(plan_of(chunks), true_seconds(chunks) / 2)
    chunk = budget.prompt_tokens(decodes, 0)
    sizes = [chunk]
    for _ in range(40):  # then steps come in at their real cost: while over the target, each chunk is smaller
        chunks = decodes + [(chunk, 0)]
        if not budget.observe(plan_of(chunks), true_seconds(chunks)):
            break
        chunk = budget.prompt_tokens(decodes, 0)
        sizes.append(chunk)
    assert len(sizes) > 1 and sizes[1] < sizes[0] and max(sizes[1:]) < sizes[0]
    assert true_seconds(decodes + [(chunk, 0)]) <= 0.03 * 1.05


def test_on_a_noisy_machine_nine_steps_in_ten_stay_within_the_target() -> None:
    """Steps take their true time times 1 +- 8% noise: a chunk sized to the fitted mean would run over in half
    the steps; the margin (the 90th percentile of observed / predicted) keeps about 90% within the target,
    without shrinking the chunks more than the noise asks."""
    rng = random.Random(1)
    target = 0.03
    budget = TokenBudget(target_s=target, max_budget=4096)
    decodes = [(1, 300)] * 8
    within, chunks = [], []
    for step in range(600):
        chunk = budget.prompt_tokens(decodes, 0)
        seconds = true_seconds(decodes + [(chunk, 0)]) * rng.gauss(1.0, 0.08)
        budget.observe(plan_of(decodes + [(chunk, 0)]), seconds)
        if step >= 100:
            within.append(seconds <= target)
            chunks.append(chunk)
    assert 0.85 <= sum(within) / len(within) <= 0.97
    noiseless = max(n for n in range(4096) if true_seconds(decodes + [(n, 0)]) <= target)
    assert 0.8 * noiseless <= sum(chunks) / len(chunks) < noiseless


def test_chunks_keep_steps_within_the_target_while_decodes_run_and_a_lone_prompt_gets_the_whole_budget() -> None:
    clock = FakeClock()
    executor = CostedExecutor(1024, clock)
    target = 0.025
    core, _ = make_core(num_blocks=1024, clock=clock, executor=executor, max_num_batched_tokens=2048,
                        target_itl_ms=target * 1e3, max_num_seqs=16)
    core.add_request(make_request("alone", prompt_len=3000, max_tokens=2, clock=clock))
    core.step()
    assert executor.plans[-1].num_prefill_tokens == 2048  # nothing decoding: the whole budget
    run_to_completion(core)
    for i in range(8):
        core.add_request(make_request(f"short{i}", prompt_len=8, max_tokens=400, clock=clock))
    for _ in range(20):  # the shorts decode; the predictor learns the machine
        core.step()
    core.add_request(make_request("long", prompt_len=3000, max_tokens=2, clock=clock))
    times = []
    while core.scheduler.requests.get("long") is not None and core.scheduler.requests["long"].num_output_tokens == 0:
        core.step()
        plan = executor.plans[-1]
        assert plan.num_decode_tokens == 8 and plan.num_prefill_tokens >= 16
        times.append(true_seconds([(s.num_tokens, s.start_position) for s in plan.scheduled]))
    assert max(times) <= target * 1.1, max(times)
    # the chunks are as large as the target allows, not a fixed small number: few steps for the prompt
    per_token = B + C * 1.5  # a prompt token's cost, roughly, over this prompt
    assert len(times) <= 1.3 * 3000 * per_token / (target - true_seconds([(1, 300)] * 8)) + 2


def test_greedy_outputs_do_not_depend_on_the_chunk_sizes(llm: LLM) -> None:
    """A long prompt arriving while another request decodes is cut into small chunks under a tight target; its
    greedy tokens equal those of the whole prompt run alone."""
    long_prompt = "Once upon a time, in a land far away, " * 30
    params = SamplingParams(max_tokens=12, temperature=0)
    [expected] = [o.outputs[0].token_ids for o in llm.generate([long_prompt], params)]
    engine = LLM(quantization="none", target_itl_ms=1.0).engine
    engine.add_request("first", "The capital of France is", SamplingParams(max_tokens=60, temperature=0,
                                                                             ignore_eos=True))
    for _ in range(12):  # it decodes, and the predictor has seen enough steps
        engine.step()
    engine.add_request("long", long_prompt, params)
    chunks, tokens = [], []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == "long" and output.finished:
                tokens = output.outputs[0].token_ids
        plan = engine.core.last_step.plan if engine.core.last_step is not None else None
        chunks += [s.num_tokens for s in (plan.scheduled if plan else []) if s.request_id == "long" and
                   s.num_tokens > 1]
    assert len(chunks) > 3 and max(chunks) < 100  # cut into small chunks while "first" decoded
    assert tokens == expected


def test_a_calibrated_profile_warm_starts_the_predictor(tmp_path) -> None:  # noqa: ANN001
    spec, hw = specs.model("llama-3-8b"), specs.hardware("h100-sxm")
    for target in (0.02, 0.05):
        budget = TokenBudget(target_s=target, max_budget=2048)
        budget.warm_start(lambda chunks: chunks_seconds(chunks, spec, hw))
        assert budget.predictor.ready
        for batch, context in ((8, 300), (32, 1000), (64, 300)):
            decodes = [(1, context)] * batch
            tokens = budget.prompt_tokens(decodes, 0)
            # the chunk is sized for the profile's roofline from the first step (a linear fit of it: within 10%)
            assert tokens > 64 and chunks_seconds(decodes + [(tokens, 0)], spec, hw) <= 1.1 * target
    path = tmp_path / "profile.json"
    specs.hardware("h100-sxm").save(path)
    engine = LLM(target_itl_ms=50.0, step_cost_profile=str(path), num_kv_blocks=64).engine
    assert engine.core.scheduler.token_budget is not None and engine.core.scheduler.token_budget.predictor.ready


def _shorts_served_before_a_long_prompt(target_itl_ms: float | None) -> tuple[list[str], float]:
    """A 3,000-token prompt is prefilled in 256-token chunks; a 40-token prompt arrives every step. Returns the
    shorts that had their first token before the long prompt did, and the long prompt's TTFT."""
    clock = FakeClock()
    executor = CostedExecutor(4096, clock)
    core, _ = make_core(num_blocks=4096, clock=clock, executor=executor, max_num_batched_tokens=256,
                        target_itl_ms=target_itl_ms, max_num_seqs=32, max_model_len=8192,
                        enable_prefix_caching=False)  # the shorts' prompts are alike: each computed in full
    start = clock()
    core.add_request(make_request("long", prompt_len=3000, max_tokens=1, clock=clock))
    served: list[str] = []
    for step in range(1000):
        if step < 20:
            core.add_request(make_request(f"short{step}", prompt_len=40, max_tokens=4, clock=clock))
        outputs = {o.request_id: o for o in core.step() if o.new_token_ids}
        if "long" in outputs:
            return served, clock() - start
        served += [r for r in outputs if r.startswith("short") and r not in served]
    raise AssertionError("the long prompt never finished")


def test_short_prompts_pass_a_long_one_by_at_most_one_chunk() -> None:
    """Shortest remaining prompt first: later short prompts are computed ahead of an earlier long one while
    the tokens they take from it stay within one chunk (max_num_batched_tokens); after that policy order
    holds and they wait for it. Without a target, policy order throughout."""
    served, ttft = _shorts_served_before_a_long_prompt(target_itl_ms=1e4)  # a target that never binds
    # six shorts pass (240 tokens ahead of the long prompt); a seventh would make it 280 > 256
    assert served == [f"short{i}" for i in range(6)]
    fcfs_served, fcfs_ttft = _shorts_served_before_a_long_prompt(target_itl_ms=None)
    assert fcfs_served == []
    # the long prompt's first token is later by at most one chunk's time (and the shorts' decodes beside it)
    one_chunk = true_seconds([(256, 3000)])
    assert fcfs_ttft < ttft <= fcfs_ttft + one_chunk + 12 * true_seconds([(1, 40)])
