"""What this machine is and how to use it: CPU feature flags (kernels and quantization modes are chosen by
them) and the threading rule OpenMP imposes."""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tokenmill.isa import flags_at, requested_level

T = TypeVar("T")


def cache_root() -> Path:
    """Where built artefacts (kernels, converted tokenizers) are kept: $TOKENMILL_CACHE_DIR or ~/.cache/tokenmill."""
    base = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tokenmill")
    return Path(base)


@functools.cache
def _malloc_trim() -> Callable[[int], object] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def release_freed_heap() -> None:
    """Hand the heap's freed pages back to the OS (glibc keeps them): after parsing a large file or converting
    tensors, the freed temporaries would otherwise stay in the process's resident memory."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags the kernels may use: the CPU's own, up to the TOKENMILL_ISA level when one is set
    (tokenmill/isa.py)."""
    return flags_at(isa_level(), raw_cpu_flags())


@functools.cache
def isa_level() -> str | None:
    """The TOKENMILL_ISA level (None: unset, the CPU's own); ValueError for a level this CPU cannot run."""
    return requested_level(raw_cpu_flags())


@functools.cache
def raw_cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def in_passing_thread(fn: Callable[[], T]) -> T:
    """Run fn in a thread that ends when fn returns, and return its result (or raise its exception).

    libgomp gives every thread that opens a parallel region its own team of worker threads, alive as long as
    that thread is. Once the live OpenMP threads outnumber the cores, libgomp stops spinning between parallel
    regions and every region pays a wake-up: measured here, a serving thread's int8 GEMMs ran 2.5x slower when
    the main thread had loaded the model (and so owned a team) before the server's engine thread started. Heavy
    set-up work done through this helper leaves no team behind.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # handed to the caller
            error.append(exc)

    thread = threading.Thread(target=run, name="tokenmill-setup")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
