"""Compiling and loading the native kernels: small C files compiled at first use for this machine (or the
TOKENMILL_ISA level below it), loaded with ctypes, the shared library cached per source, compiler flags and CPU
(`~/.cache/tokenmill/kernels`, or `$TOKENMILL_CACHE_DIR`)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tokenmill.isa import compiler_flags
from tokenmill.platform import cache_root, cpu_flags, isa_level, raw_cpu_flags

logger = logging.getLogger(__name__)
_SOURCE_DIR = Path(__file__).parent
I64, PTR, F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float  # the C kernels' argument types


@functools.cache
def build_flags() -> list[str]:
    """No -ffast-math and no implicit FMA contraction: the kernels promise the same float operations for a row
    whatever its batch (see paged_attention.c). The target: this CPU, or the TOKENMILL_ISA level below it."""
    return ["-O3", *compiler_flags(isa_level(), raw_cpu_flags()), "-ffp-contract=off", "-fopenmp", "-shared",
            "-fPIC", "-std=c11"]


def cache_dir() -> Path:
    return cache_root() / "kernels"


@functools.cache
def load_library(name: str) -> ctypes.CDLL | None:
    """Compile (once per machine) and load `<name>.c`; None when that is impossible here."""
    if os.environ.get("TOKENMILL_DISABLE_KERNELS"):
        return None
    source = _SOURCE_DIR / f"{name}.c"
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.warning("no C compiler found: native kernel %s disabled, using the torch fallback", name)
        return None
    # every source here: headers are shared (vec_exp.h) and decoder.c includes the other kernels
    sources = b"".join(f.read_bytes() for f in sorted([*_SOURCE_DIR.glob("*.c"), *_SOURCE_DIR.glob("*.h")]))
    key = hashlib.sha256(name.encode() + sources + " ".join(build_flags()).encode()
                         + " ".join(sorted(cpu_flags())).encode())
    target = cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run([compiler, *build_flags(), str(source), "-o", str(built), "-lm"],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                logger.warning("building native kernel %s failed, using the torch fallback:\n%s", name,
                               result.stderr[-2000:])
                return None
            os.replace(built, target)  # atomic: concurrent processes never load a half-written file
    # `import torch` has loaded torch's libgomp.so.1; the kernel's dependency on that soname resolves to it.
    return ctypes.CDLL(str(target))


def load_function(library: str, name: str, argtypes: list[type]) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    lib = load_library(library)
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.argtypes = argtypes
    fn.restype = None
    return fn

