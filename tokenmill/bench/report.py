"""Helpers for benchmark reports: the machine description and sections of docs/BENCHMARKS.md."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "BENCHMARKS.md"
HEADER = (
    "# Benchmarks\n\nEvery section below is written by the script named in it; rerun the script to refresh it. "
    "Numbers come from one run on a shared machine: compare ratios measured side by side in the same section.\n"
)


def machine_description() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            cpu = names[0]
    except OSError:
        pass
    device = "no GPU"
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    return (f"{cpu}, {os.cpu_count()} cores, {device}; Python {platform.python_version()}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} torch threads")


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    def fmt(v: object) -> str:
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_section(name: str, body: str, doc: Path = DOC) -> None:
    """Replace (or append) the section between `<!-- BEGIN name -->` and `<!-- END name -->`."""
    doc.parent.mkdir(parents=True, exist_ok=True)
    text = doc.read_text() if doc.exists() else HEADER
    block = f"<!-- BEGIN {name} -->\n{body.strip()}\n<!-- END {name} -->"
    pattern = re.compile(rf"<!-- BEGIN {re.escape(name)} -->.*?<!-- END {re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)
