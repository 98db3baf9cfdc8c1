"""Request migration with one engine core: SIGKILLed mid-stream, its requests wait for the restarted core and go
on there (engine/migration.py). Each kind of request ends exactly as the same request did undisturbed on the same
server: greedy text, seeded sampling with n=2 and logprobs (usage counting every token once), a structured output
whose grammar is replayed from the streamed tokens, and prompt logprobs."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import httpx
import pytest

from tests.server_utils import live_server
from tests.test_data_parallel import series, wait_for_health
from tests.test_operations import in_thread, post, read_sse

MODEL = "SmolLM2-135M-Instruct"

STREAMED: dict[str, dict[str, Any]] = {
    "greedy": {"prompt": "Tell me a story about a lighthouse", "max_tokens": 160, "ignore_eos": True,
               "temperature": 0},
    "seeded n=2, logprobs": {"prompt": "Write a poem about rain", "max_tokens": 120, "ignore_eos": True, "n": 2,
                             "temperature": 1.0, "top_p": 0.9, "seed": 7, "logprobs": 2,
                             "stream_options": {"include_usage": True}},
    # 40 two-digit numbers: it ends when the grammar is complete, which a grammar restarted from scratch would not
    "structured": {"prompt": "Some numbers:", "max_tokens": 400, "temperature": 0,
                   "structured_outputs": {"regex": "([0-9]{2}, ){40}"}},
}
WHOLE = {"prompt": "The history of the printing press", "max_tokens": 120, "ignore_eos": True, "temperature": 0,
         "prompt_logprobs": 1}


def by_choice(events: list[Any]) -> dict[int, dict[str, Any]]:
    """Per choice index: its text, tokens' logprobs and finish reason; the usage chunk under -1."""
    seen: dict[int, dict[str, Any]] = {}
    for event in events:
        if not isinstance(event, dict):
            continue
        assert "error" not in event, event
        if event.get("usage") and not event["choices"]:
            seen[-1] = event["usage"]
        for choice in event["choices"]:
            entry = seen.setdefault(choice["index"], {"text": "", "logprobs": [], "finish_reason": None})
            entry["text"] += choice["text"]
            if choice.get("logprobs"):
                entry["logprobs"] += choice["logprobs"]["token_logprobs"]
            entry["finish_reason"] = choice["finish_reason"] or entry["finish_reason"]
    return seen


def run_all(url: str, kill: threading.Event | None = None) -> tuple[dict[str, dict[int, dict[str, Any]]], Any]:
    """Every request at once; with `kill`, the engine core is SIGKILLed once each stream has a few chunks."""
    events: dict[str, list[Any]] = {name: [] for name in STREAMED}
    started = {name: threading.Event() for name in STREAMED}
    whole: dict[str, httpx.Response] = {}
    threads = [in_thread(read_sse, url, {"model": MODEL, **body}, events[name], started[name])
               for name, body in STREAMED.items()]
    threads.append(in_thread(lambda: whole.setdefault("r", post(url, {"model": MODEL, **WHOLE}))))
    assert all(e.wait(60) for e in started.values())
    if kill is not None:
        deadline = time.monotonic() + 60
        while min(len(e) for e in events.values()) < 5:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(httpx.get(url + "/health").json()["replicas"][0]["pid"], signal.SIGKILL)
        kill.set()
    for t in threads:
        t.join(240)
    for name, stream in events.items():
        assert stream[-1] == "[DONE]", (name, stream[-3:])
    return {name: by_choice(stream) for name, stream in events.items()}, whole["r"]


def assert_same(got: dict[int, dict[str, Any]], want: dict[int, dict[str, Any]]) -> None:
    assert got.keys() == want.keys()
    for index in want:
        if index == -1:
            assert got[-1] == want[-1]
            continue
        assert got[index]["text"] == want[index]["text"]
        assert got[index]["finish_reason"] == want[index]["finish_reason"]
        assert got[index]["logprobs"] == pytest.approx(want[index]["logprobs"], abs=1e-4)


def test_a_killed_core_s_requests_wait_for_its_restart_and_continue_exactly() -> None:
    with live_server("-q", "none", "--disable-log-stats") as server:
        url = server.url
        undisturbed, whole = run_all(url)
        assert undisturbed["structured"][0]["finish_reason"] == "stop"
        assert undisturbed["structured"][0]["text"].count(", ") == 40
        usage = undisturbed["seeded n=2, logprobs"][-1]
        assert usage["completion_tokens"] == 2 * 120

        killed = threading.Event()
        moved, whole_moved = run_all(url, killed)
        assert killed.is_set()
        for name in STREAMED:
            assert_same(moved[name], undisturbed[name])
        assert whole_moved.status_code == 200, whole_moved.text
        a, b = whole.json()["choices"][0], whole_moved.json()["choices"][0]
        assert a["text"] == b["text"] and a["prompt_logprobs"] is not None
        assert [e and sorted(e) for e in b["prompt_logprobs"]] == [e and sorted(e) for e in a["prompt_logprobs"]]
        assert whole_moved.json()["usage"] == whole.json()["usage"]

        health = httpx.get(url + "/health").json()
        assert health["status"] == "ok" and health["replicas"][0]["restarts"] == 1
        # every engine request in flight moved once: 1 + 2 (n=2) + 1 streamed, 1 whole
        assert series(url, "tokenmill:request_migrations_total") == {f'model_name="{MODEL}",replica="0"': 5.0}
        wait_for_health(url, "ok")
