"""The drift monitor: probes run through the live engine at its own interval agree fully with their baseline
while nothing changes (batch invariance), and the metrics move, with a warning, once a weight changes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from tokenmill.bench.server_process import live_server
from tokenmill.server.drift import Probe, ProbeAnswer, compare, load_probes
from tokenmill.server.metrics import metric_value


def _metrics(url: str) -> dict[str, float | None]:
    text = httpx.get(url + "/metrics").text
    return {name: metric_value(text, "tokenmill:" + name) for name in (
        "drift_checks_total", "drift_token_agreement", "drift_max_logprob_diff", "drift_detected_total")}


def _wait_checks(url: str, at_least: float, timeout: float = 120) -> dict[str, float | None]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        values = _metrics(url)
        if (values["drift_checks_total"] or 0) >= at_least:
            return values
        time.sleep(0.2)
    raise TimeoutError(f"fewer than {at_least} drift checks")


def test_drift_metrics_hold_until_a_weight_changes(tmp_path: Path) -> None:
    probes = tmp_path / "probes.jsonl"
    probes.write_text("\n".join(json.dumps(p) for p in [
        {"prompt": "The capital of France is", "max_tokens": 8}, "def fibonacci(n):"]))
    trigger = tmp_path / "perturb-now"
    with live_server("-q", "none", "--drift-probe", str(probes), "--drift-probe-interval", "0.01",
                     module="tests.drift_server", env={"TOKENMILL_TEST_PERTURB": str(trigger)}) as server:
        # while a client streams beside them, the probes' answers stay the baseline's exactly
        httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 32})
        steady = _wait_checks(server.url, 4)
        # float32: batches of other sizes move a logprob by float rounding at most, far under the tolerance
        assert steady["drift_token_agreement"] == 1.0 and (steady["drift_max_logprob_diff"] or 0) < 1e-4
        assert steady["drift_detected_total"] == 0.0
        trigger.touch()
        moved = _wait_checks(server.url, (steady["drift_checks_total"] or 0) + 2)
        assert moved["drift_detected_total"] and moved["drift_detected_total"] >= 1
        assert (moved["drift_max_logprob_diff"] or 0) > 1e-3 or (moved["drift_token_agreement"] or 1) < 1
    log = server.proc.stdout.read() if server.proc.stdout else ""
    assert "differ from the baseline" in log  # the warning line (the server logs at warning level here)


def test_comparison() -> None:
    same = [ProbeAnswer([1, 2, 3], [-0.1, -0.2, -0.3])]
    assert compare(same, same).changed == [] and compare(same, same).agreement == 1.0
    report = compare(same, [ProbeAnswer([1, 2, 9], [-0.1, -0.25, -1.0])])
    assert report.changed == [0] and report.agreement == pytest.approx(2 / 3)
    assert report.max_logprob_diff == pytest.approx(0.05)
    rounded = [ProbeAnswer([1, 2, 3], [-0.1, -0.20001, -0.3])]
    assert compare(same, rounded, tolerance=1e-3).changed == [] and compare(same, rounded).changed == [0]


def test_probe_files(tmp_path: Path) -> None:
    listed = tmp_path / "probes.json"
    listed.write_text(json.dumps(["hello", [1, 2, 3], {"prompt": "x", "max_tokens": 4}]))
    assert load_probes(str(listed)) == [Probe("hello"), Probe([1, 2, 3]), Probe("x", 4)]
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(ValueError, match="one or more"):
        load_probes(str(empty))
