"""What an operator relies on: vLLM-style limits, request ids, stats logging, graceful drain on SIGTERM, fault
isolation (an injected model-step fault fails only its step's requests; an injected scheduler fault makes the
process exit non-zero), per-request timeouts."""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import httpx
import pytest

from tests.fault_server import POISON_FATAL, POISON_GRAMMAR, POISON_STEP
from tests.server_utils import live_server
from tokenmill.core.outputs import SchedulerStats
from tokenmill.engine.core import StepRecord
from tokenmill.engine.stats_logger import LoggingStatLogger
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.metrics import metric_value

MODEL = "SmolLM2-135M-Instruct"


def post(url: str, body: dict[str, Any], path: str = "/v1/completions", **kwargs: Any) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120, **kwargs)


def read_sse(url: str, body: dict[str, Any], events: list[dict[str, Any] | str], started: threading.Event,
             path: str = "/v1/completions") -> None:
    """Stream a request, appending each event (a dict, or "[DONE]"); `started` is set at the first event."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
                started.set()
    started.set()


def in_thread(fn: Any, *args: Any) -> threading.Thread:
    thread = threading.Thread(target=fn, args=args, daemon=True)
    thread.start()
    return thread


def assert_idle(url: str) -> None:
    """No request running or waiting, no KV block held (polled: the gauges move after the last step)."""
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(url + "/metrics").text
        values = [metric_value(text, f"tokenmill:{name}") for name in
                  ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")]
        if values == [0.0, 0.0, 0.0] or time.monotonic() > deadline:
            assert values == [0.0, 0.0, 0.0]
            return
        time.sleep(0.1)


# ------------------------------------------------------------------ limits and request ids (shared server)


def test_max_tokens_beyond_the_context_is_a_400_with_the_numbers(base_url: str) -> None:
    models = httpx.get(base_url + "/v1/models").json()["data"][0]
    limit = models["max_model_len"]
    response = post(base_url, {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1_000_000_000_000})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert str(limit) in message and "1000000000003" in message and "3 in the prompt" in message
    chat = post(base_url, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": limit},
                path="/v1/chat/completions")
    assert chat.status_code == 400 and f"{limit} in the completion" in chat.json()["error"]["message"]
    fits = post(base_url, {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})
    assert fits.status_code == 200


@pytest.mark.parametrize("bias,fragment", [
    ({"abc": 1}, "token ids"), ({"1.5": 1}, "token ids"), ({"-3": 1}, "token ids"),
    ({"10": 101}, "[-100, 100]"), ({"49152": 5}, "out of range"),
])
def test_logit_bias_keys_must_be_token_ids_in_range(base_url: str, bias: dict[str, float], fragment: str) -> None:
    response = post(base_url, {"model": MODEL, "prompt": "x", "max_tokens": 2, "logit_bias": bias})
    assert response.status_code == 400, response.text
    assert fragment in response.json()["error"]["message"]


def test_logit_bias_steers_sampling(base_url: str, tokenizer) -> None:  # noqa: ANN001
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    plain = post(base_url, body).json()["choices"][0]["text"]
    first = tokenizer.encode(plain)[0]
    banned = post(base_url, {**body, "logit_bias": {str(first): -100}}).json()["choices"][0]["text"]
    assert tokenizer.encode(banned)[0] != first
    forced_id = tokenizer.encode(" banana")[0]
    forced = post(base_url, {**body, "logit_bias": {str(forced_id): 100}, "temperature": 0.8, "seed": 1})
    assert forced.json()["choices"][0]["text"] == tokenizer.decode([forced_id] * 4)


def test_oversized_body_is_a_413_declared_or_chunked(base_url: str) -> None:
    big = json.dumps({"model": MODEL, "prompt": "a" * (10 * 1024 * 1024 + 10)}).encode()
    declared = httpx.post(base_url + "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert declared.status_code == 413 and declared.json()["error"]["code"] == 413

    def chunks() -> Any:
        for i in range(0, len(big), 1 << 20):
            yield big[i:i + (1 << 20)]
    chunked = httpx.post(base_url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert chunked.status_code == 413
    assert post(base_url, {"model": MODEL, "prompt": "x", "max_tokens": 1}).status_code == 200


def test_x_request_id_is_honoured_and_echoed(base_url: str) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    given = post(base_url, body, headers={"X-Request-Id": "trace-42"})
    assert given.headers["x-request-id"] == "trace-42" and given.json()["id"] == "cmpl-trace-42"
    # the same id twice at once is not an error (engine ids are made unique)
    with httpx.Client(timeout=60) as client:
        threads = [in_thread(lambda: client.post(base_url + "/v1/completions", json=body,
                                                 headers={"X-Request-Id": "dup"}).raise_for_status())
                   for _ in range(2)]
        for t in threads:
            t.join()
    made = post(base_url, body)
    assert len(made.headers["x-request-id"]) == 32 and made.json()["id"] == "cmpl-" + made.headers["x-request-id"]
    error = post(base_url, {"model": MODEL, "prompt": "x", "n": 0}, headers={"X-Request-Id": "bad-1"})
    assert error.status_code == 400 and error.headers["x-request-id"] == "bad-1"


def test_stats_line_reports_throughput_and_state() -> None:
    now = [0.0]
    stat_logger = LoggingStatLogger(clock=lambda: now[0])
    assert stat_logger.log() is None  # idle: nothing to say
    stats = SchedulerStats(num_running=3, num_waiting=2, kv_usage=0.25, num_prefill_tokens=100,
                           num_generated_tokens=3, num_preemptions=1, prefix_queries=200, prefix_hits=50)
    stat_logger.on_step(StepRecord(1, 0.1, stats))
    now[0] = 10.0
    line = stat_logger.log()
    assert line is not None
    for fragment in ("prompt throughput: 10.0 tokens/s", "generation throughput: 0.3 tokens/s", "Running: 3",
                     "Waiting: 2", "KV cache usage: 25.0%", "Prefix cache hit rate: 25.0%", "Preemptions: 1"):
        assert fragment in line, (fragment, line)
    stat_logger.on_state(0, 0, 0.0)
    now[0] = 20.0
    assert "Running: 0" in (stat_logger.log() or "")  # one last line when the engine goes idle
    now[0] = 30.0
    assert stat_logger.log() is None


def test_sampling_params_validate_logit_bias() -> None:
    assert SamplingParams(logit_bias={5: -100.0}).logit_bias == {5: -100.0}
    for bad in ({-1: 1.0}, {"5": 1.0}, {5: 100.5}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------ graceful drain


def test_sigterm_drains_in_flight_requests_then_exits_zero() -> None:
    flags = ("--shutdown-timeout", "4", "--enable-log-requests", "--log-level", "info")
    with live_server(*flags, env={"TOKENMILL_LOG_STATS_INTERVAL": "0.5"}) as server:
        url = server.url
        short: list[Any] = []
        long: list[Any] = []
        short_started, long_started = threading.Event(), threading.Event()
        body = {"model": MODEL, "prompt": "Tell me a story", "ignore_eos": True, "temperature": 0}
        threads = [in_thread(read_sse, url, {**body, "max_tokens": 24}, short, short_started),
                   in_thread(read_sse, url, {**body, "max_tokens": 4000}, long, long_started)]
        assert short_started.wait(60) and long_started.wait(60)
        time.sleep(0.6)  # a stats line while busy
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        rejected = post(url, {"model": MODEL, "prompt": "x", "max_tokens": 2}, headers={"X-Request-Id": "late-1"})
        assert rejected.status_code == 503 and rejected.headers.get("retry-after")
        assert rejected.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(url + "/health").status_code == 503
        for t in threads:
            t.join(30)
        # the short stream ran to its end; the long one was cut at the shutdown timeout with an error event
        assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length"
        assert sum(len(e["choices"]) for e in short if isinstance(e, dict)) == 24
        assert long[-1] == "[DONE]" and long[-2]["error"]["code"] == 503
        assert server.proc.wait(timeout=20) == 0
        log = server.proc.stdout.read() if server.proc.stdout else ""
    assert "received request cmpl-" in log and "finished request cmpl-" in log
    assert "Avg generation throughput" in log and "drained; exiting" in log


# ------------------------------------------------------------------ faults and timeouts (a fault-injecting server)


def test_step_fault_fails_only_its_step_then_timeouts_then_fatal_fault_restarts_the_core(llm, tokenizer) -> None:  # noqa: ANN001
    prefix = tokenizer.encode("Paged attention stores the key-value cache in fixed-size blocks. " * 6)
    flags = ("-q", "none", "--max-num-seqs", "2", "--request-timeout", "4", "--migration-limit", "1",
             "--disable-log-stats")
    with live_server(*flags, module="tests.fault_server") as server:
        url = server.url
        # 1. A decodes; P (poisoned) joins it in one step, which raises; B waits for a slot (max_num_seqs 2)
        a_events: list[Any] = []
        a_started = threading.Event()
        a = in_thread(read_sse, url, {"model": MODEL, "prompt": "Count to fifty:", "max_tokens": 3000,
                                      "ignore_eos": True}, a_events, a_started)
        assert a_started.wait(60)
        responses: dict[str, httpx.Response] = {}
        p = in_thread(lambda: responses.setdefault("P", post(url, {
            "model": MODEL, "prompt": prefix + [POISON_STEP], "max_tokens": 8})))
        time.sleep(0.2)
        b = in_thread(lambda: responses.setdefault("B", post(url, {
            "model": MODEL, "prompt": prefix + [13], "max_tokens": 12, "temperature": 0})))
        for t in (p, b, a):
            t.join(60)
        assert responses["P"].status_code == 500
        assert responses["P"].json()["error"]["type"] == "internal_server_error"
        assert a_events[-1] == "[DONE]" and a_events[-2]["error"]["code"] == 500  # A shared the failed step
        # B shares P's prefix: it must not be served the KV the failed step wrote
        expected = llm.generate([{"prompt_token_ids": prefix + [13]}],
                                SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
        assert responses["B"].status_code == 200 and responses["B"].json()["choices"][0]["text"] == expected
        assert httpx.get(url + "/health").status_code == 200
        assert_idle(url)

        # 2. --request-timeout: 408 for a whole response, an error event then [DONE] for a stream
        started = time.monotonic()
        slow = post(url, {"model": MODEL, "prompt": "x", "max_tokens": 3000, "ignore_eos": True})
        assert slow.status_code == 408 and 3.5 < time.monotonic() - started < 30
        events: list[Any] = []
        read_sse(url, {"model": MODEL, "prompt": "x", "max_tokens": 3000, "ignore_eos": True}, events,
                 threading.Event())
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 408
        assert_idle(url)

        # 3. a fault in the scheduler's bookkeeping is fatal to the engine core, and the core process is replaced.
        # The request moves to the new core (--migration-limit 1), kills it too, and is not moved again: a 503
        # that says why. /health is 503 while no core is up, then serving resumes with a clean cache
        dead = post(url, {"model": MODEL, "prompt": [POISON_FATAL, 5], "max_tokens": 4})
        message = dead.json()["error"]["message"]
        assert dead.status_code == 503 and "engine stopped" in message and "--migration-limit 1" in message
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json()["replicas"][0]["state"] in ("down", "restarting")
        deadline = time.monotonic() + 120
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "the engine core was not restarted"
            time.sleep(0.25)
        assert httpx.get(url + "/health").json()["replicas"][0]["restarts"] == 2
        again = post(url, {"model": MODEL, "prompt": prefix + [13], "max_tokens": 12, "temperature": 0})
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected
        exposition = httpx.get(url + "/metrics").text
        assert metric_value(exposition, "tokenmill:replica_restarts_total") == 2.0
        assert metric_value(exposition, "tokenmill:request_migrations_total") == 1.0


def test_fatal_fault_with_the_core_in_a_thread_exits_nonzero() -> None:
    """Without engine-core processes there is nothing to restart: the server exits 1 for its supervisor."""
    with live_server("-q", "none", "--disable-log-stats", module="tests.fault_server",
                     env={"TOKENMILL_ENABLE_MULTIPROCESSING": "0"}) as server:
        dead = post(server.url, {"model": MODEL, "prompt": [POISON_FATAL, 5], "max_tokens": 4})
        assert dead.status_code == 503 and "engine stopped" in dead.json()["error"]["message"]
        assert httpx.get(server.url + "/health").status_code == 503  # the process lingers ~1 s for the errors
        assert server.proc.wait(timeout=30) == 1


def test_an_output_that_breaks_its_grammar_is_an_error_not_a_fragment(tokenizer) -> None:  # noqa: ANN001
    """A sampled token past the grammar's mask (injected) ends its request with the reason: a 500, or an error
    event when streamed, instead of `abort` with what it wrote; the server goes on."""
    body = {"model": MODEL, "prompt": tokenizer.encode("Pick a number:") + [POISON_GRAMMAR], "max_tokens": 8,
            "structured_outputs": {"regex": "[0-9]{3}"}}
    with live_server("-q", "none", "--disable-log-stats", module="tests.fault_server") as server:
        reply = post(server.url, body)
        assert reply.status_code == 500 and "broke its grammar" in reply.json()["error"]["message"], reply.text
        events: list[Any] = []
        read_sse(server.url, {**body, "stream": True}, events, threading.Event())
        assert events[-1] == "[DONE]" and "broke its grammar" in events[-2]["error"]["message"]
        fine = post(server.url, {**body, "prompt": tokenizer.encode("Pick a number:")})
        assert fine.status_code == 200 and len(fine.json()["choices"][0]["text"]) == 3
