"""The soak driver: its request mix, and a short soak against the live server (the full one is
`tokenmill bench soak`, 10,000 requests)."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter

import httpx

from tokenmill.bench import soak


def test_mix_is_seeded_and_covers_every_case() -> None:
    cases = soak.build_cases(400, seed=3, model="m")
    assert cases == soak.build_cases(400, seed=3, model="m")
    assert cases != soak.build_cases(400, seed=4, model="m")
    malformed = Counter(c.malformed for c in cases if c.malformed)
    assert set(malformed) == set(soak.MALFORMED_CASES)
    assert 0.05 < sum(malformed.values()) / len(cases) < 0.15
    streams = [c for c in cases if not c.malformed and c.stream]
    assert 0.15 < sum(c.drop_after is not None for c in streams) / len(streams) < 0.45
    assert all(1 <= c.drop_after <= 5 for c in streams if c.drop_after is not None)
    valid = [json.loads(c.body) for c in cases if not c.malformed]
    assert {b["n"] for b in valid} == {1, 2, 3} and any("stop" in b for b in valid)
    lengths = [len(b.get("prompt") or b["messages"][-1]["content"]) for b in valid]
    assert min(lengths) < 40 and max(lengths) > 1500  # a few tokens to several hundred


def test_judges_flag_what_the_soak_must_catch() -> None:
    error = json.dumps({"error": {"message": "no", "type": "invalid_request_error", "code": 400}}).encode()
    assert soak._judge_malformed(400, error).outcome == "malformed_rejected"
    assert soak._judge_malformed(200, b"{}").outcome == "malformed_accepted"
    assert soak._judge_malformed(500, error).outcome == "malformed_bad"
    assert soak._judge_malformed(422, b'{"detail": "x"}').outcome == "malformed_bad"  # not OpenAI's shape
    two = {"choices": [{"index": 0, "finish_reason": "stop"}, {"index": 1, "finish_reason": None}]}
    assert soak._judge_completion(json.dumps(two).encode(), 2).outcome == "bad"
    assert soak._judge_completion(json.dumps(two).encode(), 1).outcome == "bad"

    def stream(case: soak.SoakCase, *events: str) -> str:
        body = "".join(f"data: {e}\n\n" for e in events).encode()
        return asyncio.run(soak._read_stream(httpx.Response(200, content=body), case)).outcome

    chunk = json.dumps({"choices": [{"index": 0, "text": "a", "finish_reason": None}]})
    end = json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    case = soak.SoakCase(soak.COMPLETIONS, b"", stream=True)
    assert stream(case, chunk, end, "[DONE]") == "complete"
    assert stream(case, chunk, chunk) == "bad"  # no [DONE]
    assert stream(case, chunk, "[DONE]") == "bad"  # no finish_reason
    assert stream(soak.SoakCase(soak.COMPLETIONS, b"", stream=True, n=2), chunk, end, "[DONE]") == "bad"
    assert stream(case, chunk, '{"error": {"message": "x", "type": "y", "code": 503}}') == "bad"
    assert stream(soak.SoakCase(soak.COMPLETIONS, b"", stream=True, drop_after=1), chunk, chunk) == "dropped"


def test_short_soak_passes_every_check(base_url: str) -> None:
    report = soak.run_soak(base_url, num_requests=80, request_rate=4.0, max_concurrency=16, seed=0,
                           max_tokens=(4, 16), prompt_words=(3, 300), warmup_fraction=0.25)
    summary = soak.format_report(report)
    assert report.passed, summary
    assert len(report.checks) == 6, summary
    # Not vacuous: the run really sent malformed bodies, n>1, stop strings and streams, and dropped some.
    mix, outcomes = report.mix, report.outcomes
    assert mix["malformed"] >= 4 and outcomes["malformed_rejected"] == mix["malformed"], summary
    assert len(report.malformed_cases) >= 4, summary
    assert mix["streamed"] >= 10 and mix["n_gt_1"] >= 5 and mix["with_stop"] >= 5, summary
    assert outcomes["dropped"] >= 3, summary
    assert outcomes["complete"] >= mix["valid"] - outcomes["dropped"] - outcomes["cleanly_failed"], summary
    assert report.rss_warmup_bytes and report.rss_end_bytes


def test_cli_writes_the_report(base_url: str, tmp_path) -> None:  # noqa: ANN001
    parser = argparse.ArgumentParser()
    soak.add_args(parser)
    out = tmp_path / "soak.json"
    args = parser.parse_args(["--url", base_url, "--num-requests", "12", "--request-rate", "8", "--seed", "1",
                              "--max-tokens", "2", "6", "--output", str(out)])
    assert soak.main(args) == 0
    data = json.loads(out.read_text())
    assert data["passed"] and data["num_requests"] == 12 and sum(data["outcomes"].values()) == 12
    assert {c["name"] for c in data["checks"]} >= {"no 5xx for valid requests", "server healthy at the end"}
