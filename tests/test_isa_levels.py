"""TOKENMILL_ISA: one host runs the kernels of every instruction-set level below its own. The levels' flags and
compiler options; a level above the CPU refused; and at each lower level this host supports, the GGUF panel
kernel (AVX2 on hosts without AVX-512) and the grouped int8 kernel give the same bits as this host's own build,
and the kernel tests pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill.isa import compiler_flags, cpu_level, flags_at, requested_level, runnable_levels
from tokenmill.platform import raw_cpu_flags

ROOT = Path(__file__).resolve().parents[1]
ZEN3 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
SAPPHIRE_RAPIDS = ZEN3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx512_vnni", "avx512_bf16",
                          "avx_vnni", "amx_tile", "amx_int8", "amx_bf16"}


def test_levels_keep_the_flags_up_to_them_and_build_within_them(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_level(ZEN3) == "avx2" and cpu_level(SAPPHIRE_RAPIDS) == "avx512_vnni"
    assert cpu_level(ZEN3 | {"avx_vnni"}) == "avx2_vnni" and cpu_level({"sse2"}) == "generic"
    assert runnable_levels(SAPPHIRE_RAPIDS) == ["generic", "avx2", "avx2_vnni", "avx512", "avx512_vnni"]
    assert runnable_levels(ZEN3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}) == [
        "generic", "avx2", "avx512"]
    assert flags_at(None, SAPPHIRE_RAPIDS) == SAPPHIRE_RAPIDS
    assert not any(f.startswith(("avx512", "amx")) or f == "avx_vnni" for f in flags_at("avx2", SAPPHIRE_RAPIDS))
    assert "avx_vnni" in flags_at("avx2_vnni", SAPPHIRE_RAPIDS)
    assert flags_at("avx512", SAPPHIRE_RAPIDS) & {"avx512_vnni", "avx512_bf16", "amx_int8"} == set()
    assert not any(f.startswith(("avx", "fma")) for f in flags_at("generic", SAPPHIRE_RAPIDS))
    assert compiler_flags("avx2", SAPPHIRE_RAPIDS) == ["-march=native", "-mno-amx-tile", "-mno-amx-int8",
                                                       "-mno-amx-bf16", "-mno-avx512f", "-mno-avxvnni"]
    assert compiler_flags("avx2", ZEN3) == ["-march=native", "-mno-avx512f"]
    assert compiler_flags("generic", ZEN3)[0] == "-march=x86-64"
    for value, message in [("avx2_vnni", "lacks avx_vnni"), ("avx512", "lacks avx512"), ("sse9", "choose one of")]:
        monkeypatch.setenv("TOKENMILL_ISA", value)
        with pytest.raises(ValueError, match=message):
            requested_level(ZEN3)
    monkeypatch.setenv("TOKENMILL_ISA", "avx2")
    assert requested_level(ZEN3) == "avx2"


# the levels below this host's own that it can run (its own is what every other test runs)
LOWER = runnable_levels(raw_cpu_flags())[:-1]
OUTPUTS = """
import sys, numpy as np, torch
from tokenmill import kernels
from tokenmill.model.quant import make_linear
from tests.test_loader import _blocks_of_every_type
gen = torch.Generator().manual_seed(5)
out = {"line": kernels.prepare(), "panels": kernels.gguf_panels_available()}
for kind, data, rows, cols in _blocks_of_every_type():
    if kernels.gguf_matmul_supported(int(kind), cols):
        plan = kernels.GGUFMatmulPlan([(data, int(kind), rows, None)], cols)
        x = torch.randn(8, cols, generator=gen)  # tiles of every size from 1 to 4 (AVX2) and 8 (AVX-512)
        out[kind.name] = kernels.gguf_matmul(x, plan)
        out[kind.name + "-5"] = kernels.gguf_matmul(x[:5].contiguous(), plan)
        out[kind.name + "-one"] = kernels.gguf_matmul(x[3:4].contiguous(), plan)
if kernels.int8_grouped_available():
    torch.manual_seed(0)
    layer = make_linear("int8", 96, 40, bias=True)
    layer.load(torch.randn(40, 96), torch.randn(40))
    out["int8"] = layer(torch.randn(9, 96, generator=gen))
torch.save(out, sys.argv[1])
"""


def _outputs(level: str | None, path: Path) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "TOKENMILL_ISA"} | ({"TOKENMILL_ISA": level} if level else {})
    subprocess.run([sys.executable, "-c", OUTPUTS, str(path)], cwd=ROOT, env=env, check=True, timeout=600)
    return torch.load(path)


@pytest.mark.skipif(not LOWER, reason="this host runs no level below its own")
def test_every_lower_level_computes_the_same_bits(tmp_path: Path) -> None:
    own = _outputs(None, tmp_path / "own.pt")
    for level in LOWER:
        if level == "generic":
            continue  # no integer kernels there: GGUF and int8 layers run other backends
        theirs = _outputs(level, tmp_path / f"{level}.pt")
        assert f"for {level} (TOKENMILL_ISA)" in str(theirs["line"])
        assert theirs["panels"], level  # AVX2 hosts repack GGUF weights into panels too
        assert set(theirs) == set(own), level
        for name, value in own.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, theirs[name]), (level, name)  # type: ignore[arg-type]


@pytest.mark.skipif(not LOWER, reason="this host runs no level below its own")
@pytest.mark.parametrize("level", LOWER)
def test_the_kernel_tests_pass_at_a_lower_level(level: str) -> None:
    env = os.environ | {"TOKENMILL_ISA": level}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                             "tests/test_kernels.py", "tests/test_kv_quant.py"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
