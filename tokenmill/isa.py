"""x86 instruction-set levels the native kernels are built for, and `TOKENMILL_ISA`, which picks a level below the
CPU's own so that one host can run and measure the paths of lesser CPUs (an AVX-512 host testing its AVX2 ones).

A level keeps the CPU flags up to it (`cpu_flags` reports only those, so every choice made from the flags, such
as the `auto` quantization mode, is the lower CPU's) and builds the kernels with `-march=native` minus what lies
above it, so their `#if defined(__AVX512F__)`-style branches take the lower path."""

from __future__ import annotations

import os
from collections.abc import Iterable

# lowest first; a level names what its kernels use: avx2_vnni is AVX2 with the VEX vpdpbusd (Alder Lake, Zen 5)
ISA_LEVELS = ("generic", "avx2", "avx2_vnni", "avx512", "avx512_vnni")
ENV = "TOKENMILL_ISA"

_AVX512_BASE = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"})
_AVX2_BASE = frozenset({"avx2", "fma"})


_NEEDS = {"generic": frozenset(), "avx2": _AVX2_BASE, "avx2_vnni": _AVX2_BASE | {"avx_vnni"},
          "avx512": _AVX512_BASE, "avx512_vnni": _AVX512_BASE | {"avx512_vnni"}}


def runnable_levels(flags: Iterable[str]) -> list[str]:
    """The levels a CPU with these /proc/cpuinfo flags runs, lowest first."""
    have = set(flags)
    return [level for level in ISA_LEVELS if _NEEDS[level] <= have]


def cpu_level(flags: Iterable[str]) -> str:
    """The highest level a CPU with these /proc/cpuinfo flags runs."""
    return runnable_levels(flags)[-1]


def requested_level(raw_flags: frozenset[str]) -> str | None:
    """TOKENMILL_ISA checked against the CPU (None: unset, the CPU's own level); ValueError past the CPU."""
    value = os.environ.get(ENV, "").strip().lower()
    if not value or value == "native":
        return None
    if value not in ISA_LEVELS:
        raise ValueError(f"{ENV}={value!r}: choose one of {', '.join(ISA_LEVELS)}")
    if not _NEEDS[value] <= raw_flags:  # an AVX-512 CPU without AVX-VNNI runs avx2, not avx2_vnni
        missing = ", ".join(sorted(_NEEDS[value] - raw_flags))
        raise ValueError(f"{ENV}={value}: this CPU lacks {missing} (its level: {cpu_level(raw_flags)})")
    return value


def flags_at(level: str | None, raw_flags: frozenset[str]) -> frozenset[str]:
    """The CPU flags a kernel of this level may use (None: all of them)."""
    if level is None:
        return raw_flags
    kept = {f for f in raw_flags if not f.startswith("amx")}  # the tiles lie above every level named here
    if level == "avx512_vnni":
        return frozenset(kept)
    kept.discard("avx_vnni")
    if level == "avx512":
        return frozenset(f for f in kept if not f.startswith("avx512") or f in _AVX512_BASE)
    kept -= {f for f in kept if f.startswith("avx512")}
    if level == "avx2_vnni":
        return frozenset(kept | {"avx_vnni"})
    if level == "avx2":
        return frozenset(kept)
    return frozenset(f for f in kept if not f.startswith(("avx", "fma", "f16c")))


def compiler_flags(level: str | None, raw_flags: frozenset[str]) -> list[str]:
    """`-march` and `-mno-*` flags that keep gcc's output (and the kernels' #if branches) within the level."""
    if level is None:
        return ["-march=native"]
    if level == "generic":
        return ["-march=x86-64", "-mtune=native"]
    off = [f"-mno-{flag.replace('_', '-')}" for flag in ("amx_tile", "amx_int8", "amx_bf16") if flag in raw_flags]
    if level == "avx512":
        off += ["-mno-avx512vnni", "-mno-avx512bf16", "-mno-avx512vbmi", "-mno-avx512vbmi2", "-mno-avx512ifma",
                "-mno-avx512bitalg", "-mno-avx512vpopcntdq"]
    elif level in ("avx2", "avx2_vnni"):
        off.append("-mno-avx512f")  # every AVX-512 subset with it
    if level not in ("avx2_vnni", "avx512_vnni") and "avx_vnni" in raw_flags:
        off.append("-mno-avxvnni")
    return ["-march=native", *off]
