#!/usr/bin/env bash
# The CUDA path, checked once on a GPU machine (benchmarks/gpu_check.sh; README "Devices"). Under 8 minutes on
# one H200. That machine has PyTorch, Triton and transformers but no package registry, so the rest of
# tokenmill's dependencies travel with the working tree:
#   here (a machine with pip):   bash benchmarks/gpu_check.sh prepare   # pure-Python/small wheels -> .gpu_deps
#   there:                       bash benchmarks/gpu_check.sh run       # results under $OUT (or /tmp/gpu_check)
# The bundled model is too large to travel, so the parity checks run on the tiny random models of every family
# (tests/test_families.py, against transformers on the device) and the benchmark on random weights of a real
# shape (benchmarks/bench_gpu.py).
set -uo pipefail
cd "$(dirname "$0")/.."
DEPS=.gpu_deps
mode=${1:-run}
if [ "$mode" = prepare ]; then
    # what tokenmill and pytest need beyond torch / triton / transformers (and their own dependencies: numpy,
    # jinja2, tokenizers, safetensors, pyyaml, tqdm); must stay under the device tool's 64 MiB carry
    rm -rf "$DEPS"
    # wheels for the GPU machine's Python (PYVER=3.12 ...; default: this one's)
    platform_args=()
    if [ -n "${PYVER:-}" ]; then
        platform_args=(--python-version "$PYVER" --only-binary=:all: --platform manylinux2014_x86_64
                       --platform manylinux_2_28_x86_64)
    fi
    .venv/bin/pip install -q --no-deps --target "$DEPS" "${platform_args[@]}" gguf llguidance pyzmq fastapi starlette pydantic \
        pydantic-core annotated-types typing-inspection annotated-doc uvicorn h11 click anyio sniffio \
        prometheus-client pytest pluggy iniconfig
    du -sh "$DEPS"
    exit 0
fi
OUTDIR=${OUT:-/tmp/gpu_check}
mkdir -p "$OUTDIR"
export PYTHONPATH="$PWD:$PWD/$DEPS${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
status=0
run() {  # name, limit in seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "== $name" | tee -a "$OUTDIR/summary.txt"
    if timeout "$limit" "$@" > "$OUTDIR/$name.log" 2>&1; then
        echo "   ok" | tee -a "$OUTDIR/summary.txt"
    else
        echo "   FAILED ($?)" | tee -a "$OUTDIR/summary.txt"
        tail -30 "$OUTDIR/$name.log"
        status=1
    fi
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUTDIR/gpu.txt" 2>&1
$PY -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" \
    >> "$OUTDIR/gpu.txt" 2>&1
cat "$OUTDIR/gpu.txt"
if ! $PY -c "import tokenmill.engine.llm_engine, fastapi, zmq, llguidance, gguf, pytest" 2> "$OUTDIR/imports.log"; then
    echo "missing dependencies (run 'PYVER=<this python> bash benchmarks/gpu_check.sh prepare' where pip works):"
    cat "$OUTDIR/imports.log"
    exit 2
fi
# 1. the Triton kernels compiled for the GPU, against the torch reference, on the device
run triton_kernels 120 env TRITON_INTERPRET=0 TOKENMILL_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider \
    tests/test_triton_kernels.py
# 2. every family against transformers, greedy tokens identical in float32, on the device
run families 180 env TOKENMILL_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider tests/test_families.py \
    -k "greedy_tokens_match_transformers"
# 3. decode batch 1-256 (CUDA graphs and eager, their logits compared) and prefill 512/2048 against the device's
#    copy bandwidth
run bench 150 $PY benchmarks/bench_gpu.py --device cuda --out "$OUTDIR/bench_gpu.md"
cat "$OUTDIR/bench_gpu.md" 2>/dev/null
# 4. `tokenmill serve --device cuda` answers a request
run serve 90 $PY - <<'PY'
import json, subprocess, sys, tempfile, time, urllib.request
from pathlib import Path
sys.path.insert(0, "benchmarks")
from bench_gpu import SHAPES, write_model
tmp = tempfile.mkdtemp()
write_model(Path(tmp), SHAPES["tiny"])
server = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", tmp, "--device", "cuda", "--port", "8765"])
try:
    for _ in range(120):
        try:
            urllib.request.urlopen("http://127.0.0.1:8765/health", timeout=1)
            break
        except OSError:
            time.sleep(0.5)
    body = json.dumps({"prompt": "w5 w6 w7", "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request("http://127.0.0.1:8765/v1/completions", body, {"content-type": "application/json"})
    answer = json.load(urllib.request.urlopen(request, timeout=30))
    print(answer)
    assert answer["usage"]["completion_tokens"] == 8
finally:
    server.terminate()
    server.wait(10)
PY
echo "status $status" | tee -a "$OUTDIR/summary.txt"
exit $status
