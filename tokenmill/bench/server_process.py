"""Run `tokenmill serve` as a child process on a free loopback port (benchmarks and tests)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LiveServer:
    url: str
    proc: subprocess.Popen[str]


@contextmanager
def live_server(*args: str, timeout: float = 180.0, quiet: bool = True,
                omp_wait_policy: str | None = "PASSIVE", module: str = "tokenmill.cli",
                env: dict[str, str] | None = None, own_process_group: bool = False) -> Iterator[LiveServer]:
    """Start a server with the given `tokenmill serve` flags, wait until /health answers, stop it after.

    `omp_wait_policy` None leaves OpenMP's default (threads spin a while before sleeping). `module` is run
    with `python -m MODULE serve ...`; `env` adds environment variables. `own_process_group`: the server leads
    a session of its own, so that a signal to its process group (as systemd sends one) reaches it and its
    helpers, not the caller."""
    port = free_port()
    env = {**os.environ, **(env or {})}
    env.pop("OMP_WAIT_POLICY", None)
    if omp_wait_policy:
        env["OMP_WAIT_POLICY"] = omp_wait_policy
    cmd = [sys.executable, "-m", module, "serve", "--port", str(port), "--log-level", "warning", *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE if quiet else None, stderr=subprocess.STDOUT,
                            text=True, start_new_session=own_process_group)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                output = proc.stdout.read() if proc.stdout else ""
                raise RuntimeError(f"server exited early:\n{output}")
            try:
                if httpx.get(base + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("server did not become healthy")
            time.sleep(0.25)
        yield LiveServer(base, proc)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
