"""The native kernels build on CPUs other than x86 (their x86 paths sit behind `#if defined(__AVX2__)`-style
guards; elsewhere the portable C and the torch paths run): every kernel source cross-compiled for aarch64 with
zig's clang (the `ziglang` package), warnings about undeclared functions and intrinsics as errors, with OpenMP
and without it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[1] / "tokenmill" / "kernels"


@pytest.mark.parametrize("source", sorted(p.name for p in KERNELS.glob("*.c")))
def test_every_kernel_cross_compiles_for_aarch64(source: str, tmp_path: Path) -> None:
    base = [sys.executable, "-m", "ziglang", "cc", "-target", "aarch64-linux-gnu", "-O2", "-std=c11", "-fPIC",
            "-ffp-contract=off", "-Werror=implicit-function-declaration", "-Werror=int-conversion", "-c",
            str(KERNELS / source)]
    # zig ships no OpenMP runtime header for cross targets: the OpenMP build is checked with a declaration-only one
    include = tmp_path / "include"
    include.mkdir()
    (include / "omp.h").write_text("int omp_get_max_threads(void);\nint omp_get_thread_num(void);\n")
    for extra in ([], ["-fopenmp", "-I", str(include)]):
        result = subprocess.run([*base, *extra, "-o", str(tmp_path / "out.o")], capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, (extra, result.stderr[-3000:])
