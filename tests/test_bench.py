"""Load generator statistics against hand-computed values, workloads, and a run against a live server."""

from __future__ import annotations

import argparse
import asyncio
import json
import math

import pytest

from tokenmill.bench import workloads
from tokenmill.bench.loadgen import arrival_times, run_load
from tokenmill.bench.stats import RequestResult, percentiles, summarize
from tokenmill.sampling_params import SamplingParams


def test_request_result_derived_timings() -> None:
    r = RequestResult(ok=True, output_tokens=3, start=0.5, ttft=0.5, e2e=2.0, chunk_times=[1.0, 1.5, 2.5])
    assert r.itls == [0.5, 1.0]
    assert r.tpot == pytest.approx((2.0 - 0.5) / 2)
    assert RequestResult(ok=True, output_tokens=1, ttft=0.2, e2e=0.2).tpot is None


def test_percentiles_by_hand() -> None:
    p = percentiles([1.0, 2.0, 3.0, 4.0])
    assert p["mean"] == 2.5 and p["p50"] == 2.5
    assert p["p90"] == pytest.approx(3.7)  # rank 0.9 * 3 = 2.7 -> 3 + 0.7 * (4 - 3)
    assert p["p99"] == pytest.approx(3.97)
    assert math.isnan(percentiles([])["mean"])


def test_summary_throughput_and_goodput_by_hand() -> None:
    fast = RequestResult(ok=True, prompt_tokens=10, output_tokens=5, ttft=0.5, e2e=1.3, chunk_times=[0, 1, 2, 3, 4])
    slow = RequestResult(ok=True, prompt_tokens=20, output_tokens=3, ttft=3.0, e2e=4.0, chunk_times=[0, 1, 2])
    failed = RequestResult(ok=False, error="HTTP 500")
    s = summarize([fast, slow, failed], duration=10.0, slo_ttft=1.0, slo_tpot=0.5)
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["request_throughput"] == pytest.approx(0.2)
    assert s["output_throughput"] == pytest.approx(0.8)
    assert s["total_token_throughput"] == pytest.approx(3.8)
    assert s["ttft_s"]["mean"] == pytest.approx(1.75)
    assert s["tpot_s"]["p50"] == pytest.approx((0.2 + 0.5) / 2)  # fast: 0.8/4, slow: 1.0/2
    assert s["itl_s"]["mean"] == pytest.approx(1.0)
    assert s["goodput"] == pytest.approx(0.1)  # only `fast` meets TTFT <= 1 s
    assert s["good_share"] == pytest.approx(1 / 3)


def test_arrivals_burst_poisson_and_scripted() -> None:
    items = [workloads.WorkItem("x", [1], 4) for _ in range(2000)]
    assert arrival_times(items[:5], float("inf"), 0) == [0.0] * 5
    times = arrival_times(items, 4.0, seed=3)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.08)
    assert times == arrival_times(items, 4.0, seed=3)
    scripted = [workloads.WorkItem("x", [1], 4, arrival_offset=2.5), workloads.WorkItem("y", [1], 4)]
    assert arrival_times(scripted, 1.0, 0)[0] == 2.5


def test_workloads_are_deterministic_and_shaped(tokenizer) -> None:  # noqa: ANN001
    a = workloads.mixed(tokenizer, 40, seed=5)
    assert [i.prompt_token_ids for i in a] == [i.prompt_token_ids for i in workloads.mixed(tokenizer, 40, seed=5)]
    assert all(32 <= len(i.prompt_token_ids) <= 512 and 8 <= i.max_tokens <= 512 for i in a)
    outs = sorted(i.max_tokens for i in a)
    assert outs[len(outs) // 2] < sum(outs) / len(outs)  # heavy tail: mean above median
    shared = workloads.shared_prefix(tokenizer, 5, seed=1)
    prefix = shared[0].prompt_token_ids[:768]
    assert all(i.prompt_token_ids[:768] == prefix for i in shared)
    assert len({tuple(i.prompt_token_ids) for i in shared}) == 5
    fixed = workloads.random_lengths(tokenizer, 3, input_len=32, output_len=256, seed=2)
    assert [(len(i.prompt_token_ids), i.max_tokens) for i in fixed] == [(32, 256)] * 3
    assert len({tuple(i.prompt_token_ids) for i in fixed}) == 3
    inter = workloads.long_interference(tokenizer, seed=0)
    assert len(inter[-1].prompt_token_ids) == 3000 and inter[-1].arrival_offset and inter[-1].arrival_offset > 0


def test_sharegpt_file(tmp_path, tokenizer) -> None:  # noqa: ANN001
    data = [{"conversations": [{"from": "human", "value": f"Question {i}?"}, {"from": "gpt", "value": "Answer " * i}]}
            for i in range(1, 6)] + [{"conversations": []}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    items = workloads.sharegpt(tokenizer, str(path), 3, seed=0)
    assert len(items) == 3 and all(i.prompt.startswith("Question") and i.max_tokens >= 1 for i in items)


def test_load_against_a_live_server(base_url: str, tokenizer) -> None:  # noqa: ANN001
    items = [workloads.WorkItem(p, tokenizer.encode(p), n) for p, n in
             [("Hello there", 6), ("The sky is", 9), ("Once upon", 4), ("Numbers: 1, 2,", 7)]]
    results, duration = asyncio.run(run_load(base_url, "SmolLM2-135M-Instruct", items, request_rate=20.0,
                                             max_concurrency=2, seed=1, progress=False))
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.output_tokens for r in results] == [6, 9, 4, 7]
    assert [r.prompt_tokens for r in results] == [len(i.prompt_token_ids) for i in items]
    for r in results:
        assert 0 < r.ttft <= r.e2e <= duration
        assert r.chunk_times == sorted(r.chunk_times) and len(r.chunk_times) >= 1
    summary = summarize(results, duration, slo_ttft=60.0, slo_tpot=60.0)
    assert summary["completed"] == 4 and summary["good_share"] == 1.0
    assert summary["output_throughput"] == pytest.approx(26 / duration)


def test_bench_serve_cli_writes_json(base_url: str, tmp_path, capsys) -> None:  # noqa: ANN001
    from tokenmill.bench import serve_cli

    out = tmp_path / "bench.json"
    parser = argparse.ArgumentParser()
    serve_cli.add_args(parser)
    args = parser.parse_args(["--base-url", base_url, "--num-requests", "3", "--max-prompt", "64",
                              "--max-output", "8", "--slo-ttft", "30", "--slo-tpot", "5",
                              "--output-json", str(out)])
    assert serve_cli.main(args) == 0
    printed = capsys.readouterr().out
    assert "completed 3, failed 0" in printed and "goodput" in printed
    report = json.loads(out.read_text())
    assert report["summary"]["completed"] == 3 and len(report["requests"]) == 3


def test_peer_protocol_prefills_every_repeat(llm) -> None:  # noqa: ANN001
    """The offline comparison with OpenVINO GenAI (prefix caching off there) repeats the same prompts: tokenmill's
    side must prefill them every time too, never answer a repeat from its prefix cache."""
    from tokenmill.bench.offline import peer_protocol_llm, peer_protocol_rates

    prompts = ["The history of computing is a story of layers, each hiding the one below. " * 3,
               "Serving language models is a scheduling problem as much as an arithmetic one. " * 3]
    with pytest.raises(ValueError, match="prefix caching off"):
        peer_protocol_rates(llm, "Once upon a time", prompts)  # the shared fixture caches prefixes
    ours = peer_protocol_llm("none")
    assert not ours.engine.config.enable_prefix_caching
    rates = peer_protocol_rates(ours, "Once upon a time", prompts, repeats=2, single_tokens=4, batch_tokens=4)
    assert len(rates.single) == len(rates.batch) == 2 and min(rates.single + rates.batch) > 0
    assert rates.prefix_hit_tokens == 0
    # the same prompts on an engine that caches prefixes do hit: the check above could fail
    hits_before = llm.engine.core.kv.prefix_hits
    llm.generate(prompts + prompts, SamplingParams(temperature=0, max_tokens=1))
    assert llm.engine.core.kv.prefix_hits > hits_before


def test_agent_sessions_grow_histories_in_shuffled_rounds(base_url: str, tokenizer) -> None:  # noqa: ANN001
    """The workload's shape, and a small run against the live server: later turns resend the whole history
    (the previous prompt, its answer, the new tokens) and find most of it cached."""
    from tokenmill.bench import agent_sessions

    system, sessions = agent_sessions.build_sessions(tokenizer, 3, 3, seed=1, append_range=(40, 80),
                                                     system_tokens=64)
    again = agent_sessions.build_sessions(tokenizer, 3, 3, seed=1, append_range=(40, 80), system_tokens=64)
    assert (system, [s.turns for s in sessions]) == (again[0], [s.turns for s in again[1]])
    assert all(40 <= len(turn) - len(tokenizer.encode(agent_sessions.QUESTION, add_special_tokens=False)) <= 80
               for s in sessions for turn in s.turns)
    order = agent_sessions.turn_order(3, 3, seed=1)
    assert [turn for _, turn in order] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(sorted(s for s, t in order if t == turn) == [0, 1, 2] for turn in range(3))
    run = agent_sessions.SessionRun(tokenizer, system, sessions)
    model = agent_sessions.httpx.get(base_url + "/v1/models").json()["data"][0]["id"]
    results = run.run(agent_sessions.OpenAITurns(base_url, model), order, max_tokens=4)
    by_key = {(r.session, r.turn): r for r in results}
    for session in range(3):
        first, second = by_key[(session, 0)], by_key[(session, 1)]
        assert second.prompt_tokens > first.prompt_tokens + 40
        assert second.cached_tokens >= (first.prompt_tokens // 16) * 16 - 16  # its first turn's blocks
    summary = agent_sessions.summarize_turns(results)
    assert list(summary["by_turn"]) == ["1", "2", "3"] and summary["by_turn"]["3"]["cached_share"] > 0.5
