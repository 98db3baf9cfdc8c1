"""Where a model's load time goes: the phases of reading a file and building the model runner, timed, then the
top functions by cumulative time under cProfile.

`python benchmarks/profile_load.py MODEL --quantization auto` (MODEL: a GGUF file or HF directory; default the
bundled SmolLM2). Phases: the header and config (`load_model`), the tokenizer, then the runner (every weight
read, dequantized and converted by its backend, the KV pool allocated, the kernels built).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from tokenmill.config import EngineConfig
from tokenmill.executor.model_runner import ModelRunner
from tokenmill.model.loader import load_model
from tokenmill.model.tokenizer import Tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--rows", type=int, default=15, help="functions to list")
    args = parser.parse_args()
    profiler = cProfile.Profile()
    profiler.enable()
    start = time.perf_counter()
    loaded = load_model(args.model)
    header = time.perf_counter()
    Tokenizer.from_path(loaded.path, loaded.gguf_reader)
    tokenizer = time.perf_counter()
    ModelRunner(EngineConfig(model=args.model, quantization=args.quantization), loaded.config, loaded.weights)
    runner = time.perf_counter()
    profiler.disable()
    print(f"header and config {header - start:.2f} s, tokenizer {tokenizer - header:.2f} s, "
          f"weights and runner {runner - tokenizer:.2f} s, total {runner - start:.2f} s (under cProfile)")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.rows)


if __name__ == "__main__":
    main()
