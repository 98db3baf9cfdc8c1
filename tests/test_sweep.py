"""`tokenmill bench sweep`'s pieces: the verdicts never say "met" on an empty measurement, the interference run
refuses to measure streams that do not overlap the long prompt, deadlines cut what a client would have cut, the
closed loop and the simulator's saturation count tokens the same way."""

from __future__ import annotations

import asyncio
import math
import time

import httpx

from tokenmill.bench import workloads
from tokenmill.bench.loadgen import run_closed_loop, run_load
from tokenmill.bench.stats import RequestResult, summarize
from tokenmill.bench.sweep import default_output_dir
from tokenmill.bench.sweep_load import Capacity, RatePoint, SingleStream, deadline_for, knee_rate, points_requests
from tokenmill.bench.sweep_report import SweepData, gap_verdict, knee_verdict, ratio_verdict
from tokenmill.bench.sweep_scenarios import InterferenceRun, overlap_problem, plan_interference
from tokenmill.bench.sweep_sim import cut_at, saturated_rate
from tokenmill.config import EngineConfig
from tokenmill.server.metrics import metric_value
from tokenmill.sim import specs
from tokenmill.sim.simulator import Simulation

MODEL = "SmolLM2-135M-Instruct"


def test_ratio_verdicts_never_meet_on_an_empty_measurement() -> None:
    assert "met" in ratio_verdict(6.0, 2.0, 3) and "NOT" not in ratio_verdict(6.0, 2.0, 3)
    assert "NOT met" in ratio_verdict(5.0, 2.0, 3)
    assert "invalid run" in ratio_verdict(4.0, 0.0, 3)  # the old page said "infx: met" here
    assert "invalid run" in ratio_verdict(math.nan, 1.0, 3)
    assert "invalid run" in ratio_verdict(9.0, 1.0, 3, problem="streams did not overlap")


def _point(rate: float, good: float) -> RatePoint:
    summary = {"good_share": good, "ttft_s": {"p50": 0.1, "p90": 0.2}, "tpot_s": {"p50": 0.01, "p90": 0.02}}
    return RatePoint(rate, rate, summary, 10, 0, 1.0)


def _data(points: dict[str, list[RatePoint]]) -> SweepData:
    capacity = Capacity("static", 8, 100.0, 1.0, 10.0, 4.0, 0.1)
    return SweepData("m", "p", "w", SingleStream(0.1, 0.01, 1000.0), 0.3, 0.02, "given", 0.9, [capacity],
                     {"static": capacity, "dynamic": capacity, "continuous": capacity}, points)


def test_goodput_knee_stops_at_the_first_rate_missing_the_slos() -> None:
    points = [_point(1.0, 1.0), _point(2.0, 0.95), _point(3.0, 0.5), _point(4.0, 0.92)]
    assert knee_rate(points) == 2.0  # 4.0 is past the knee: a lucky point beyond it does not count
    assert knee_rate([_point(1.0, 0.5)]) is None


def test_knee_verdict_is_a_lower_bound_when_static_never_meets_the_slos() -> None:
    data = _data({"continuous": [_point(1.0, 1.0), _point(4.0, 0.95)], "static": [_point(1.0, 0.2)]})
    assert "> 4.00x" in knee_verdict(data, 3) and "met (a lower bound)" in knee_verdict(data, 3)
    data = _data({"continuous": [_point(1.0, 0.5)], "static": [_point(1.0, 0.95)]})
    assert "NOT met" in knee_verdict(data, 3)
    data = _data({"continuous": [_point(3.0, 0.95)], "static": [_point(1.0, 0.95), _point(2.0, 0.1)]})
    assert "3.00x" in knee_verdict(data, 3) and "NOT" not in knee_verdict(data, 3)


def test_gap_verdict_needs_overlap_and_a_real_stall() -> None:
    data = _data({})
    data.interference = {"chunked, budget 256": InterferenceRun(256, 0.1, 0.01, 3.0, None),
                         "no chunking": InterferenceRun(4096, 2.5, 0.01, 2.5, None)}
    assert "25.00x" in gap_verdict(data) and "NOT" not in gap_verdict(data)
    data.interference["no chunking"] = InterferenceRun(4096, 0.3, 0.01, 0.3, None)
    assert "invalid run" in gap_verdict(data)  # a 0.3 s stall is no stall to remove
    data.interference["no chunking"] = InterferenceRun(4096, 2.5, 0.01, 2.5, "a short stream ended early")
    assert "invalid run" in gap_verdict(data)


def _stream(times: list[float], start: float = 0.0) -> RequestResult:
    return RequestResult(ok=True, output_tokens=len(times), start=start, ttft=times[0] - start,
                         e2e=times[-1] - start, chunk_times=times)


def test_overlap_check_refuses_streams_that_ended_before_the_long_prompt() -> None:
    long_prompt = _stream([5.0, 5.1], start=2.0)  # arrives at 2 s, first token at 5 s
    running = [_stream([0.1 * i for i in range(1, 70)]) for _ in range(4)]  # 0.1 .. 6.9 s
    assert overlap_problem([*running, long_prompt]) is None
    finished_early = [_stream([0.1 * i for i in range(1, 30)]) for _ in range(4)]  # over by 2.9 s
    assert "ended before" in (overlap_problem([*finished_early, long_prompt]) or "")
    late = [_stream([2.5, 6.0, 7.0], start=2.4)]
    assert "had not started" in (overlap_problem([*late, long_prompt]) or "")


def test_the_long_prompt_is_sized_from_the_measured_prefill_speed() -> None:
    plan = plan_interference(SingleStream(0.05, 0.01, prefill_tokens_per_s=1000.0), max_model_len=8192)
    assert plan.long_prompt == 2560 and plan.estimated_prefill_s >= 2.0
    # the short streams decode past arrival + 2.5x the prefill estimate at a slower pace than alone
    assert plan.short_output * 0.013 >= plan.arrival_s + 2.5 * plan.estimated_prefill_s
    capped = plan_interference(SingleStream(0.05, 0.01, prefill_tokens_per_s=50_000.0), max_model_len=8192)
    assert capped.long_prompt == 8192 - 64 and capped.short_output <= 8192 - 64


def test_deadline_and_point_sizes_by_hand() -> None:
    items = [workloads.WorkItem("", [1], n) for n in (10, 300, 50)]
    # a request arriving last and meeting both SLOs ends by then: TTFT SLO + 300 tokens at the TPOT SLO
    assert deadline_for(items, arrivals_end=20.0, slo_ttft=0.5, slo_tpot=0.02) == 20.0 + 0.5 + 6.0 + 1.0
    assert points_requests(10.0, 100, 30.0, 24) == 100
    assert points_requests(1.0, 100, 30.0, 24) == 30
    assert points_requests(0.2, 100, 30.0, 24) == 24


def test_cut_at_keeps_what_arrived_before_the_deadline() -> None:
    done = _stream([1.0, 2.0], start=0.5)
    late = _stream([3.0, 4.0, 9.0, 10.0], start=2.0)
    never = _stream([11.0, 12.0], start=8.0)
    kept, cut, unstarted = cut_at([done, late, never], deadline=8.0)
    assert kept is done
    assert not cut.ok and cut.chunk_times == [3.0, 4.0] and cut.ttft == 1.0 and cut.e2e is None
    assert not unstarted.ok and unstarted.chunk_times == [] and unstarted.ttft is None
    summary = summarize([kept, cut, unstarted], 8.0, slo_ttft=5.0, slo_tpot=5.0)
    assert summary["good_share"] == 1 / 3  # cut requests count outside the SLOs


def test_simulated_saturation_ranks_continuous_above_static(tokenizer) -> None:  # noqa: ANN001
    items = workloads.mixed(tokenizer, 40, seed=3, prompt_range=(16, 128), output_range=(8, 256),
                            output_median=48)
    rates = {}
    for mode in ("static", "continuous"):
        config = EngineConfig(batching=mode, max_num_seqs=8, enable_prefix_caching=False)
        sim = Simulation(specs.model("smollm2-135m"), specs.hardware("h100-sxm"), config, num_kv_blocks=4096)
        rates[mode] = saturated_rate(sim, items)
    # a static batch waits for its longest answer: on a memory-bound device its slots idle meanwhile
    assert rates["continuous"] > 1.5 * rates["static"] > 0


def test_closed_loop_keeps_the_load_and_cuts_the_tail(base_url: str, tokenizer) -> None:  # noqa: ANN001
    items = workloads.random_lengths(tokenizer, 5, 16, 24, seed=4)
    loop = asyncio.run(run_closed_loop(base_url, MODEL, items, concurrency=2))
    assert len(loop.results) == 5 and loop.sends == sorted(loop.sends) and loop.end == loop.sends[-1]
    # the last one sent is cut at once; the other open one is cut too unless its answer was already in
    assert 3 <= sum(r.ok for r in loop.results) <= 4 and not loop.results[-1].ok
    assert all(r.output_tokens == 24 for r in loop.results if r.ok)
    assert loop.output_rate(loop.start) > 0
    _wait_idle(base_url)


def test_a_deadline_cuts_open_requests_and_the_server_frees_them(base_url: str, tokenizer) -> None:  # noqa: ANN001
    items = workloads.random_lengths(tokenizer, 2, 16, 2000, seed=5)
    results, duration = asyncio.run(run_load(base_url, MODEL, items, progress=False, deadline=0.8))
    assert duration < 5.0
    for r in results:
        assert not r.ok and r.error == "cut at the deadline"
        assert 0 < len(r.chunk_times) < 2000  # what streamed before the cut is kept
    _wait_idle(base_url)


def _wait_idle(base_url: str) -> None:
    """The server aborts what a client dropped: nothing stays running, no KV block stays held."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        text = httpx.get(base_url + "/metrics").text
        if metric_value(text, "tokenmill:num_requests_running") == 0 and \
                metric_value(text, "tokenmill:kv_cache_usage_perc") == 0:
            return
        time.sleep(0.2)
    raise AssertionError("the server still holds the cut requests")


def test_output_defaults_to_the_clone_docs() -> None:
    out = default_output_dir()
    assert out.name in ("docs", "tokenmill-sweep") and "site-packages" not in str(out)


def test_report_renders_every_part_with_its_verdicts(tmp_path) -> None:  # noqa: ANN001
    from tokenmill.bench.sweep_report import report_body, write_plots
    from tokenmill.bench.sweep_scenarios import InterferencePlan, PrefixRun

    points = {m: [_point(1.0, 1.0), _point(2.0, 0.5)] for m in ("static", "dynamic", "continuous")}
    data = _data(points)
    data.capacities = [Capacity("static", 8, 100.0, 1.0, 10.0, 4.0, 0.1), Capacity("static", 16, 120.0, 1.2, 10.0,
                                                                                  8.0, 0.2)]
    data.best = {"static": data.capacities[1], "dynamic": data.capacities[1],
                 "continuous": Capacity("continuous", 64, 0.0, 0.0, 10.0, 60.0, 0.3)}
    data.simulated_points = {m: [_point(1.0, 1.0), _point(2.0, 0.9)] for m in points}
    data.interference_plan = InterferencePlan(2048, 2.1, 500, 1.5)
    data.interference = {"chunked, budget 256": InterferenceRun(256, 0.1, 0.01, 3.0, None, [(0.1, 0.1)]),
                         "no chunking": InterferenceRun(4096, 2.5, 0.01, 2.5, None, [(0.1, 2.5)])}
    summary = {"ttft_s": {"mean": 0.5, "p50": 0.5, "p90": 0.6}}
    data.prefix = {"off": PrefixRun(summary, 0.0, [0.5, 0.6]), "on": PrefixRun(summary, 0.9, [0.05, 0.06])}
    plots = write_plots(data, tmp_path / "plots", "x-")
    assert sorted(plots.values()) == ["x-interference.png", "x-prefix_ttft_cdf.png", "x-rates.png"]
    assert all((tmp_path / "plots" / name).stat().st_size > 0 for name in plots.values())
    body = report_body(data, plots, "model", time_target_min=20)
    # continuous measured nothing here: the throughput line must not call a ratio met
    assert "output throughput at saturation: **0.00x** (target >= 3x: NOT met)" in body
    assert "largest batch swept (16)" in body
    assert "TTFT p90" in body and "(>25%)" not in body.split("### 1.")[0]
    assert "Prefix caching, mean TTFT off vs on: **1.00x** (target >= 5x: NOT met)" in body
