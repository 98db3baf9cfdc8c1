"""`tokenmill serve --data-parallel-size 2`: two engine-core processes behind one front end and the router.

One live server (real model, float32) for the whole story: outputs equal a single engine's, a shared prefix
sticks to the replica that cached it, and killing each replica's process in turn mid-load loses nothing: the dead
one's streams continue on the other, token for token, and the killed one comes back.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from typing import Any

import httpx

from tests.conftest import LONG_PARAGRAPH, PLAIN_PROMPTS
from tests.server_utils import live_server
from tests.test_operations import in_thread, post, read_sse
from tokenmill.sampling_params import SamplingParams

MODEL = "SmolLM2-135M-Instruct"


def series(url: str, name: str) -> dict[str, float]:
    """Every sample of a metric, keyed by its label text."""
    text = httpx.get(url + "/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text,
                                                                re.M)}


def wait_for_health(url: str, status: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(url + "/health").json()["status"] != status:
        assert time.monotonic() < deadline, f"/health did not say {status!r}"
        time.sleep(0.1)


def wait_idle(url: str) -> None:
    deadline = time.monotonic() + 15
    while True:
        values = [v for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
                  for v in series(url, f"tokenmill:{name}").values()]
        if not any(values) or time.monotonic() > deadline:
            assert len(values) == 6 and not any(values), values
            return
        time.sleep(0.1)


def test_two_replicas_match_one_engine_route_by_prefix_and_lose_nothing_when_killed(llm) -> None:  # noqa: ANN001
    with live_server("-q", "none", "--data-parallel-size", "2", "--disable-log-stats") as server:
        url = server.url
        health = httpx.get(url + "/health").json()
        assert health["status"] == "ok" and [r["state"] for r in health["replicas"]] == ["up", "up"]
        pids = [r["pid"] for r in health["replicas"]]
        assert len(set(pids)) == 2 and server.proc.pid not in pids

        # 1. greedy outputs, all prompts at once (spread over both replicas), equal the single engine's
        params = SamplingParams(max_tokens=16, temperature=0)
        expected = [o.outputs[0].text for o in llm.generate(PLAIN_PROMPTS, params)]
        responses: dict[int, httpx.Response] = {}
        threads = [in_thread(lambda i=i, p=p: responses.__setitem__(i, post(url, {
            "model": MODEL, "prompt": p, "max_tokens": 16, "temperature": 0}))) for i, p in enumerate(PLAIN_PROMPTS)]
        for t in threads:
            t.join(120)
        assert [responses[i].json()["choices"][0]["text"] for i in range(len(PLAIN_PROMPTS))] == expected
        routed = series(url, "tokenmill:router_decisions_total")
        assert all(sum(v for k, v in routed.items() if f'replica="{r}"' in k) > 0 for r in (0, 1)), routed
        wait_idle(url)

        # 2. two long system prompts, three questions each: after the first, each goes where its prefix is cached
        before = sum(v for k, v in routed.items() if 'reason="prefix"' in k)
        for question in ("Why?", "How?", "When?"):
            for system in ("You are a pirate. " + LONG_PARAGRAPH * 2, "You are a poet. " + LONG_PARAGRAPH * 2):
                assert post(url, {"model": MODEL, "prompt": system + question, "max_tokens": 2}).status_code == 200
        routed = series(url, "tokenmill:router_decisions_total")
        assert sum(v for k, v in routed.items() if 'reason="prefix"' in k) - before == 4, routed
        assert sum(series(url, "tokenmill:prefix_cache_hits_total").values()) > 0

        # 3. eight greedy streams under way on both replicas, each engine core SIGKILLed in turn: the dead one's
        # requests move to the other (engine/migration.py) and every stream ends as an undisturbed run does, token
        # for token, with no error; /health says degraded while a replica is down
        num_tokens = 400
        prompts = PLAIN_PROMPTS[:8]
        undisturbed = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(
            max_tokens=num_tokens, temperature=0, ignore_eos=True))]
        routed_before = series(url, "tokenmill:router_decisions_total")
        streams: list[list[Any]] = [[] for _ in prompts]
        started = [threading.Event() for _ in prompts]
        threads = [in_thread(read_sse, url, {"model": MODEL, "prompt": p, "max_tokens": num_tokens, "ignore_eos": True,
                                             "temperature": 0}, streams[i], started[i]) for i, p in enumerate(prompts)]
        assert all(e.wait(60) for e in started)
        routed = series(url, "tokenmill:router_decisions_total")
        on_first = sum(v - routed_before.get(k, 0.0) for k, v in routed.items() if 'replica="0"' in k)
        assert 0 < on_first < len(prompts), routed  # both replicas serve some of them
        os.kill(pids[0], signal.SIGKILL)
        wait_for_health(url, "degraded")
        during = post(url, {"model": MODEL, "prompt": PLAIN_PROMPTS[1], "max_tokens": 16, "temperature": 0})
        assert during.status_code == 200 and during.json()["choices"][0]["text"] == expected[1]
        wait_for_health(url, "ok")
        assert not any(s and s[-1] == "[DONE]" for s in streams), "a stream ended before the second kill"
        os.kill(httpx.get(url + "/health").json()["replicas"][1]["pid"], signal.SIGKILL)  # it serves all 8 now
        for t in threads:
            t.join(180)
        for stream, text in zip(streams, undisturbed):
            assert stream[-1] == "[DONE]" and not any("error" in e for e in stream if isinstance(e, dict)), stream[-3:]
            chunks = [e for e in stream if isinstance(e, dict) and e["choices"]]
            assert "".join(e["choices"][0]["text"] for e in chunks) == text
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        moved = series(url, "tokenmill:request_migrations_total")
        assert moved == {f'model_name="{MODEL}",replica="0"': on_first,
                         f'model_name="{MODEL}",replica="1"': float(len(prompts))}, moved
        deadline = time.monotonic() + 120
        while httpx.get(url + "/health").json()["status"] != "ok":
            assert time.monotonic() < deadline, "the killed replica did not come back"
            time.sleep(0.25)
        health = httpx.get(url + "/health").json()
        assert [r["restarts"] for r in health["replicas"]] == [1, 1]
        assert not {r["pid"] for r in health["replicas"]} & set(pids)
        assert series(url, "tokenmill:replica_restarts_total") == {
            f'model_name="{MODEL}",replica="0"': 1.0, f'model_name="{MODEL}",replica="1"': 1.0}
        # the restarted replica takes requests again (fresh prompts, sent together, are spread by load)
        def routed_to(replica: int) -> float:
            return sum(v for k, v in series(url, "tokenmill:router_decisions_total").items()
                       if f'replica="{replica}"' in k)

        before = routed_to(1)
        answers: dict[int, httpx.Response] = {}
        threads = [in_thread(lambda i=i: answers.__setitem__(i, post(url, {
            "model": MODEL, "prompt": f"Fresh prompt number {i}:", "max_tokens": 8}))) for i in range(4)]
        for t in threads:
            t.join(120)
        assert all(answers[i].status_code == 200 for i in range(4)) and routed_to(1) > before
        wait_idle(url)
