"""Machine facts and the set-up thread helper."""

from __future__ import annotations

import threading

import pytest

from tokenmill.platform import cpu_flags, in_passing_thread


def test_in_passing_thread_returns_the_result_from_another_thread() -> None:
    caller = threading.get_ident()
    assert in_passing_thread(lambda: threading.get_ident()) != caller
    assert in_passing_thread(lambda: [1, 2]) == [1, 2]


def test_in_passing_thread_raises_the_exception_in_the_caller() -> None:
    def fail() -> None:
        raise KeyError("missing weight")

    with pytest.raises(KeyError, match="missing weight"):
        in_passing_thread(fail)


def test_cpu_flags_are_read_on_linux() -> None:
    flags = cpu_flags()
    assert isinstance(flags, frozenset)
    with open("/proc/cpuinfo") as f:
        if any(line.startswith("flags") for line in f):
            assert "fpu" in flags or "sse2" in flags
