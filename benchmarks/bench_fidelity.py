"""Greedy fidelity to transformers' float32 outputs on the same GGUF weights, per quantization mode and for
llama.cpp's llama-server on the same file.

The parity prompts of tests/ (plain and chat, 1 to ~1,000 tokens), 48 greedy tokens each with EOS masked
(transformers' `min_new_tokens`, tokenmill's `min_tokens`, llama-server's `ignore_eos`). A prompt counts as
faithful when the output equals transformers' up to the first step whose top-2 gap (in transformers' float32
logits) is under 0.1 nats: past a near-tie, either token is a correct greedy choice. Also reported: the
prompts whose 48 tokens are all equal, and the mean length of the common prefix.

`python benchmarks/bench_fidelity.py [--model FILE]` prints the table and writes the "fidelity" section of
docs/BENCHMARKS.md (the bundled SmolLM2 by default).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_peers import llamacpp_server  # noqa: E402
from tests.conftest import CHAT_PROMPTS, PLAIN_PROMPTS  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.report import machine_description, markdown_table, write_section  # noqa: E402
from tokenmill.model.loader import bundled_model_path  # noqa: E402
from tokenmill.model.tokenizer import Tokenizer  # noqa: E402

NEW_TOKENS = 48
NEAR_TIE = 0.1  # nats
MODES = ("none", "auto", "gguf", "int8", "bf16")


def reference(path: str) -> tuple[list[list[int]], list[list[int]], list[list[float]]]:
    """(prompt ids, transformers' greedy tokens, the top-2 gap of its logits at each step)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.dirname(path), os.path.basename(path)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    prompts = [tokenizer(p, add_special_tokens=True).input_ids for p in PLAIN_PROMPTS]
    if tokenizer.chat_template is not None:
        prompts += [list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)) for m in CHAT_PROMPTS]
    else:  # a base model's file names no template: the family's (tokenmill's built-in one)
        prompts += [Tokenizer.from_path(path).encode_chat(m) for m in CHAT_PROMPTS]
    outputs, gaps = [], []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            outputs.append(out.sequences[0, len(ids):].tolist())
            top2 = [step[0].float().topk(2).values for step in out.logits]
            gaps.append([float(t[0] - t[1]) for t in top2])
    return prompts, outputs, gaps


def tokenmill_outputs(path: str, mode: str, prompts: list[list[int]]) -> list[list[int]]:
    """mode: a --quantization, optionally with a --kv-cache-dtype after a colon (auto:float32)."""
    quantization, _, kv_cache_dtype = mode.partition(":")
    llm = LLM(path, quantization=quantization, kv_cache_dtype=kv_cache_dtype or "auto")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outputs]


def llamacpp_outputs(path: str, prompts: list[list[int]], kv_type: str = "f16") -> list[list[int]] | None:
    """llama-server's greedy tokens for the prompts (None where llama.cpp is not built); `kv_type`: its K/V cache
    type (-ctk/-ctv; quantized V needs flash attention)."""
    extra = () if kv_type == "f16" else ("-ctk", kv_type, "-ctv", kv_type, "-fa", "on")
    with llamacpp_server(path, extra) as url:
        if url is None:
            return None
        outputs = []
        for ids in prompts:  # token ids in, as given (no BOS added); greedy; EOS ignored
            reply = httpx.post(url + "/completion", timeout=300, json={
                "prompt": ids, "n_predict": NEW_TOKENS, "temperature": 0, "top_k": 1, "ignore_eos": True,
                "cache_prompt": False, "return_tokens": True}).json()
            outputs.append(list(reply["tokens"]))
        return outputs


def score(outputs: list[list[int]], expected: list[list[int]], gaps: list[list[float]]) -> tuple[int, int, float]:
    """(faithful prompts, identical prompts, mean common prefix in tokens)."""
    faithful = identical = 0
    prefixes = []
    for got, want, gap in zip(outputs, expected, gaps, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        prefixes.append(same)
        identical += got == want
        faithful += got == want or (same < len(gap) and gap[same] < NEAR_TIE)
    return faithful, identical, statistics.mean(prefixes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2)")
    parser.add_argument("--modes", nargs="*", default=list(MODES),
                        help="--quantization values, each optionally with :KV_CACHE_DTYPE (auto:float32)")
    parser.add_argument("--llama-kv-types", nargs="*", default=["f16"],
                        help="llama-server's K/V cache types to run (f16 = its default; q8_0, q4_0, ...)")
    parser.add_argument("--section", default="fidelity",
                        help="docs/BENCHMARKS.md section to write, followed by the file's name (kv-fidelity: the "
                             "KV cache dtypes' runs)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    path = args.model or bundled_model_path()
    prompts, expected, gaps = reference(path)
    rows: list[list[object]] = []
    for mode in args.modes:
        faithful, identical, prefix = score(tokenmill_outputs(path, mode, prompts), expected, gaps)
        quantization, _, kv = mode.partition(":")
        name = f"tokenmill -q {quantization}" + (f" --kv-cache-dtype {kv}" if kv else "")
        rows.append([name, f"{faithful}/{len(prompts)}", f"{identical}/{len(prompts)}",
                     f"{prefix:.1f}"])
        print(rows[-1], flush=True)
    for kv_type in args.llama_kv_types:
        peer = llamacpp_outputs(path, prompts, kv_type)
        if peer is None:
            break
        faithful, identical, prefix = score(peer, expected, gaps)
        name = "llama.cpp llama-server" + ("" if kv_type == "f16" else f" -ctk/-ctv {kv_type}")
        rows.append([name, f"{faithful}/{len(prompts)}", f"{identical}/{len(prompts)}", f"{prefix:.1f}"])
        print(rows[-1], flush=True)
    table = markdown_table(["engine", "faithful (equal up to a near-tie)", f"all {NEW_TOKENS} tokens equal",
                            "mean common prefix (tokens)"], rows)
    body = (f"## Greedy fidelity to transformers float32 (`python benchmarks/bench_fidelity.py`)\n\n"
            f"Machine: {machine_description()}. {' '.join(__doc__.split(chr(10) + chr(10))[1].split())} "
            f"File: {Path(path).name}, {len(prompts)} prompts.\n\n{table}\n")
    print(table)
    if not args.no_write:
        write_section(f"{args.section}-{Path(path).stem.lower()}", body)
        print("wrote docs/BENCHMARKS.md")


if __name__ == "__main__":
    main()
