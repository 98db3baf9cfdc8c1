"""`--distributed-executor-backend ray`: two engine-core replicas as Ray actors on a local Ray cluster.

Runs when Ray is installed (`pip install 'tokenmill[ray]'`; `make test` installs it). The cluster is started
the way an operator would (`ray start --head`), with token authentication on and the token passed in the
environment, so nothing is written under the home directory.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.conftest import PLAIN_PROMPTS
from tests.server_utils import free_port, live_server
from tests.test_operations import post
from tokenmill.sampling_params import SamplingParams

ray = pytest.importorskip("ray")
MODEL = "SmolLM2-135M-Instruct"


@contextmanager
def ray_cluster() -> Iterator[dict[str, str]]:
    """A one-node Ray cluster with 2 CPUs; yields the environment a driver needs to join it."""
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray-")  # short: Ray's socket paths live under it
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
           "RAY_USAGE_STATS_ENABLED": "0"}
    ray_cli = str(Path(sys.executable).with_name("ray"))
    subprocess.run([ray_cli, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                    f"--temp-dir={temp_dir}", "--disable-usage-stats"], env=env, check=True, capture_output=True)
    try:
        yield {key: env[key] for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_USAGE_STATS_ENABLED")} | {
            "RAY_ADDRESS": f"127.0.0.1:{port}"}
    finally:
        subprocess.run([ray_cli, "stop", "--force"], env=env, capture_output=True)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_two_replicas_as_ray_actors_match_one_engine_and_come_back_when_killed(llm) -> None:  # noqa: ANN001
    params = SamplingParams(max_tokens=12, temperature=0)
    prompts = PLAIN_PROMPTS[:6]
    expected = [o.outputs[0].text for o in llm.generate(prompts, params)]
    with ray_cluster() as env, live_server("-q", "none", "--data-parallel-size", "2",
                                           "--distributed-executor-backend", "ray", "--disable-log-stats",
                                           env=env, timeout=300) as server:
        url = server.url
        health = httpx.get(url + "/health").json()
        pids = [r["pid"] for r in health["replicas"]]
        assert health["status"] == "ok" and len(set(pids)) == 2 and server.proc.pid not in pids
        texts = [post(url, {"model": MODEL, "prompt": p, "max_tokens": 12, "temperature": 0}).json()["choices"][0][
            "text"] for p in prompts]
        assert texts == expected
        # an actor's process killed: the front end relaunches it through Ray
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 180
        while (h := httpx.get(url + "/health").json())["status"] != "ok" or h["replicas"][0]["restarts"] != 1:
            assert time.monotonic() < deadline, h
            time.sleep(0.5)
        assert h["replicas"][0]["pid"] != pids[0]
        again = [post(url, {"model": MODEL, "prompt": p, "max_tokens": 12, "temperature": 0}).json()["choices"][0][
            "text"] for p in prompts]
        assert again == expected
