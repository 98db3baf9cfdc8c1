"""`tokenmill serve --disaggregated 1P1D`: a prefill engine and a decode engine, one process each, the prompt's
KV moved between them. One live server (real model, float32) for the whole story."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import httpx

from tests.conftest import LONG_PARAGRAPH, PLAIN_PROMPTS
from tests.server_utils import live_server
from tests.test_data_parallel import series, wait_for_health, wait_idle
from tests.test_operations import in_thread, post, read_sse
from tokenmill.engine.async_engine import PREFILL_NICENESS
from tokenmill.sampling_params import SamplingParams

MODEL = "SmolLM2-135M-Instruct"


def assert_prefill_niced(health: dict[str, Any]) -> None:
    """The prefill engine yields its CPU to the front end it shares it with; the decode engine does not."""
    prefill, decode = (os.getpriority(os.PRIO_PROCESS, r["pid"]) for r in health["replicas"])
    assert decode == os.getpriority(os.PRIO_PROCESS, 0)
    assert prefill == min(19, decode + PREFILL_NICENESS)


def test_1p1d_matches_colocated_frees_everything_and_loses_nothing_when_an_engine_dies(llm) -> None:  # noqa: ANN001
    params = SamplingParams(max_tokens=16, temperature=0)
    expected = [o.outputs[0].text for o in llm.generate(PLAIN_PROMPTS, params)]
    with live_server("-q", "none", "--disaggregated", "1P1D", "--disable-log-stats") as server:
        url = server.url
        health = httpx.get(url + "/health").json()
        assert [(r["role"], r["state"]) for r in health["replicas"]] == [("producer", "up"), ("consumer", "up")]
        assert_prefill_niced(health)

        # 1. alone, then all at once, streamed or not: the colocated engine's greedy outputs
        body = {"model": MODEL, "max_tokens": 16, "temperature": 0}
        assert post(url, {**body, "prompt": PLAIN_PROMPTS[1]}).json()["choices"][0]["text"] == expected[1]
        events: list[Any] = []
        read_sse(url, {**body, "prompt": PLAIN_PROMPTS[3]}, events, threading.Event())
        assert "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict)) == expected[3]
        responses: dict[int, httpx.Response] = {}
        threads = [in_thread(lambda i=i, p=p: responses.__setitem__(i, post(url, {**body, "prompt": p})))
                   for i, p in enumerate(PLAIN_PROMPTS)]
        for t in threads:
            t.join(120)
        assert [responses[i].json()["choices"][0]["text"] for i in range(len(PLAIN_PROMPTS))] == expected
        moved = series(url, "tokenmill:kv_transfer_bytes_count")
        assert sum(moved.values()) == len(PLAIN_PROMPTS) + 2
        wait_idle(url)
        assert series(url, "tokenmill:kv_transfer_pending") == {f'model_name="{MODEL}",replica="0"': 0.0}

        # 2. the prefill engine killed while prompts queue on it: nothing is lost. Those it had handed over
        # decode on; the rest run on the decode engine, prompt included (engine/migration.py), while it is down;
        # every stream ends as it does colocated
        long_prompt = LONG_PARAGRAPH * 30  # ~1,300 tokens each: the prefill engine is busy for seconds
        prompts = [f"{i}. {long_prompt}" for i in range(10)]  # no shared prefix: each prefill takes its time
        streams: list[list[Any]] = [[] for _ in range(10)]
        started = [threading.Event() for _ in range(10)]
        threads = [in_thread(read_sse, url, {**body, "prompt": p, "max_tokens": 64, "ignore_eos": True}, streams[i],
                             started[i]) for i, p in enumerate(prompts)]
        assert started[0].wait(120)
        os.kill(health["replicas"][0]["pid"], signal.SIGKILL)
        for t in threads:
            t.join(240)
        checked = [0, 9]  # the first prefilled before the kill, the last after it
        colocated = llm.generate([prompts[i] for i in checked], SamplingParams(max_tokens=64, temperature=0,
                                                                               ignore_eos=True))
        for stream in streams:
            assert stream[-1] == "[DONE]" and not any("error" in e for e in stream if isinstance(e, dict))
            assert sum(len(e["choices"][0]["text"]) > 0 for e in stream if isinstance(e, dict)) > 0
        for i, output in zip(checked, colocated):
            assert "".join(e["choices"][0]["text"] for e in streams[i] if isinstance(e, dict)) == output.outputs[0].text
        assert 0 < sum(series(url, "tokenmill:request_migrations_total").values()) < 10
        wait_for_health(url, "ok")
        assert post(url, {**body, "prompt": PLAIN_PROMPTS[2]}).json()["choices"][0]["text"] == expected[2]

        # 3. the decode engine killed mid-stream: its requests wait for it to come back and go on there
        long_answer = llm.generate([PLAIN_PROMPTS[3]], SamplingParams(max_tokens=300, temperature=0,
                                                                      ignore_eos=True))[0].outputs[0].text
        events = []
        first = threading.Event()
        thread = in_thread(read_sse, url, {**body, "prompt": PLAIN_PROMPTS[3], "max_tokens": 300, "ignore_eos": True},
                           events, first)
        assert first.wait(60)
        while len(events) < 10:
            time.sleep(0.05)
        os.kill(httpx.get(url + "/health").json()["replicas"][1]["pid"], signal.SIGKILL)
        thread.join(240)
        assert events[-1] == "[DONE]" and not any("error" in e for e in events if isinstance(e, dict))
        assert "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict)) == long_answer
        wait_for_health(url, "ok")
        assert_prefill_niced(httpx.get(url + "/health").json())  # the restarted one too
        wait_idle(url)
