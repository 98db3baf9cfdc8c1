"""The disk tier's namespace: everything a block's KV depends on besides its tokens (and the salts its chained
hash already carries: rope length, LoRA adapter, cache_salt). Blocks written under another namespace are never
looked at, so a changed model file, dtype, KV dtype, block size or kernel set starts an empty tier."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

SAMPLE_BYTES = 1 << 20  # a file's identity: its size and its first and last MiB (reading all of it costs seconds)
LAYOUT_VERSION = 1  # bump when a block's bytes change meaning (layouts, key channel scales, ...)


def file_identity(path: str | Path) -> str:
    """A digest of a model file (size, name, first and last MiB) or directory (the same over its files)."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.blake2b(digest_size=16)
    for file in files:
        size = file.stat().st_size
        h.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            h.update(f.read(SAMPLE_BYTES))
            if size > 2 * SAMPLE_BYTES:
                f.seek(size - SAMPLE_BYTES)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def kv_namespace(model_path: str | Path, settings: dict[str, Any]) -> str:
    """The directory name blocks of this model under these settings live in. Chained block hashes are Python's
    tuple hashes of ints (the same in every process of one Python version): the version is part of it."""
    parts = {"layout": LAYOUT_VERSION, "python": list(sys.version_info[:2]), "model": file_identity(model_path),
             **settings}
    digest = hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=10).hexdigest()
    return f"{Path(model_path).name[:40]}-{digest}"
