"""Drain under every way a supervisor or a terminal delivers the stop: SIGTERM to the server's whole process group
(systemd's KillMode=control-group, `kill -- -PGID`), to the front end alone, repeated, and SIGINT from a terminal
(Ctrl-C reaches the foreground group); with one engine core, two (data parallel) and 1P1D. In every case the
stream in flight runs to its end, new requests get 503, /health answers 503, the process exits 0, and no helper
process (fork server, engine cores, resource tracker) outlives it."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.server_utils import LiveServer, live_server
from tests.test_operations import in_thread, post, read_sse

MODEL = "SmolLM2-135M-Instruct"
BODY = {"model": MODEL, "prompt": "Tell me a story", "ignore_eos": True, "temperature": 0}


def group_members(pgid: int) -> set[int]:
    """The live processes of a process group (read from /proc)."""
    members = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[2]) == pgid:
                members.add(int(entry))
    return members


def to_group(server: LiveServer, sig: int) -> None:
    os.killpg(server.proc.pid, sig)


def to_front_end_twice(server: LiveServer, sig: int) -> None:
    server.proc.send_signal(sig)
    time.sleep(0.2)
    server.proc.send_signal(sig)


def to_group_then_front_end(server: LiveServer, sig: int) -> None:
    os.killpg(server.proc.pid, sig)
    time.sleep(0.2)
    server.proc.send_signal(sig)


DELIVERIES: list[tuple[str, tuple[str, ...], Callable[[LiveServer, int], None], int]] = [
    ("group SIGTERM", (), to_group, signal.SIGTERM),
    ("front end SIGTERM twice", (), to_front_end_twice, signal.SIGTERM),
    ("group SIGTERM, then the front end's again, DP 2", ("--data-parallel-size", "2"), to_group_then_front_end,
     signal.SIGTERM),
    ("group SIGTERM, 1P1D", ("--disaggregated", "1P1D"), to_group, signal.SIGTERM),
]


def chunks(events: list[Any]) -> int:
    return sum(len(e["choices"]) for e in events if isinstance(e, dict) and "choices" in e)


def assert_draining(url: str) -> None:
    rejected = post(url, {"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert rejected.status_code == 503 and rejected.headers.get("retry-after")
    assert httpx.get(url + "/health").status_code == 503


def assert_all_gone(members: set[int]) -> None:
    deadline = time.monotonic() + 10
    while (alive := {pid for pid in members if _alive(pid)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"helper processes outlived the server: {alive}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("name,flags,deliver,sig", DELIVERIES, ids=[d[0] for d in DELIVERIES])
def test_a_stream_in_flight_drains_whatever_the_delivery(name: str, flags: tuple[str, ...],
                                                         deliver: Callable[[LiveServer, int], None],
                                                         sig: int) -> None:
    with live_server("--shutdown-timeout", "60", "--disable-log-stats", *flags, own_process_group=True) as server:
        members = group_members(server.proc.pid)
        assert len(members) >= 3, members  # front end, fork server, engine core(s), resource tracker
        events: list[Any] = []
        started = threading.Event()
        reader = in_thread(read_sse, server.url, {**BODY, "max_tokens": 200}, events, started)
        assert started.wait(60)
        deliver(server, sig)
        time.sleep(0.3)
        assert_draining(server.url)
        reader.join(120)
        assert events[-1] == "[DONE]" and chunks(events) == 200, events[-3:]
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(timeout=30) == 0
    assert_all_gone(members)


def test_sigint_from_a_terminal_drains_and_a_second_one_cuts_it_short() -> None:
    with live_server("--shutdown-timeout", "120", "--disable-log-stats", own_process_group=True) as server:
        members = group_members(server.proc.pid)
        short: list[Any] = []
        long: list[Any] = []
        short_started, long_started = threading.Event(), threading.Event()
        readers = [in_thread(read_sse, server.url, {**BODY, "max_tokens": 200}, short, short_started),
                   in_thread(read_sse, server.url, {**BODY, "max_tokens": 4000}, long, long_started)]
        assert short_started.wait(60) and long_started.wait(60)
        to_group(server, signal.SIGINT)  # Ctrl-C: the terminal signals the foreground process group
        time.sleep(0.3)
        assert_draining(server.url)
        readers[0].join(120)
        assert short[-1] == "[DONE]" and chunks(short) == 200
        assert not long or long[-1] != "[DONE]"  # still streaming: the drain waits for it
        cut_at = time.monotonic()
        to_group(server, signal.SIGINT)  # Ctrl-C again: stop now
        readers[1].join(30)
        assert long[-1] == "[DONE]" and long[-2]["error"]["code"] == 503 and chunks(long) < 4000
        assert server.proc.wait(timeout=30) == 0 and time.monotonic() - cut_at < 15
    assert_all_gone(members)

