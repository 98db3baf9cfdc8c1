"""Decode and prefill on one device with the model runner, against the device's memory roofline measured in
the same run: tok/s at decode batch 1-256 (each sequence 512 tokens of context) and prompt tok/s at 512 / 2048
tokens, and for decode the bytes a step must read (weights + KV) divided by its time, as a share of the
measured copy bandwidth. Decode steps are timed twice: replaying the CUDA graphs the runner captured at start-up,
and eagerly (`--enforce-eager`), with the largest difference between the two runners' logits.

The model is random weights of a real shape (default Llama-3.2-1B's: hidden 2048, 16 layers, GQA 32/8, vocab
128k) written as a Hugging Face directory, so the check needs no download. `python benchmarks/bench_gpu.py
--device cuda` (benchmarks/gpu_check.sh runs it); `--device cpu --shape tiny` checks the script itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.core.outputs import ScheduledRequest, SchedulerOutput  # noqa: E402
from tokenmill.executor.model_runner import ModelRunner  # noqa: E402
from tokenmill.model.loader import load_model  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

SHAPES = {
    "llama-3.2-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256},
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 512},
}
CONTEXT = 512


def write_model(directory: Path, shape: dict[str, int]) -> None:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.LlamaConfig(max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
                                      eos_token_id=2, **shape)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    vocab = {f"w{i}": i for i in range(shape["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "w1", "eos_token": "w2"}))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: object, repeats: int) -> float:
    assert callable(fn)
    fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """GB/s of a large device-to-device copy (read + write)."""
    size = 2**28 if device.type == "cuda" else 2**26
    a = torch.empty(size, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    seconds = timed(device, lambda: b.copy_(a), 5)
    return 2 * size / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--out", default=None, help="also write the table here (markdown)")
    args = parser.parse_args()
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp), SHAPES[args.shape])
        loaded = load_model(tmp)
        blocks_needed = max(args.batches) * (CONTEXT // 16 + 2) + max(args.prompts) // 16 + 2
        config = EngineConfig(model=tmp, device=args.device, num_kv_blocks=blocks_needed,
                              max_num_batched_tokens=max(args.prompts), max_num_seqs=max(args.batches))
        runner = ModelRunner(config, loaded.config, loaded.weights)
        eager = ModelRunner(dataclasses.replace(config, enforce_eager=True), loaded.config, loaded.weights)
    # weights held as parameters or buffers (a quantized layer's), not the rope tables
    tensors = list(runner.model.parameters()) + [b for name, b in runner.model.named_buffers()
                                                 if b.dim() > 1 and "rope" not in name]
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors)
    weight_count = sum(t.numel() for t in tensors if t.is_floating_point() or t.dtype == torch.int8)
    kv_token_bytes = runner.kv_cache_bytes // (runner.num_kv_blocks * runner.block_size)
    bandwidth = copy_bandwidth(device)
    lines = [f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
             f"shape {args.shape}, linear layers `{runner.quantization}`, KV `{runner.kv_format.name}`, weights "
             f"{weight_bytes / 2**30:.2f} GiB, copy bandwidth {bandwidth:.0f} GB/s; decode steps "
             f"{'replay CUDA graphs' if runner.decode_graphs is not None else 'eager (no CUDA graphs here)'}", "",
             "| step | tok/s | step ms | bytes read / step time, share of copy bandwidth | eager tok/s | "
             "graphs / eager | logits vs eager (max abs diff / max abs) |", "|---|---|---|---|---|---|---|"]
    params = SamplingParams(temperature=0.0)
    for batch in args.batches:
        scheduled = []
        for i in range(batch):
            table = list(range(i * (CONTEXT // 16 + 1), (i + 1) * (CONTEXT // 16 + 1)))
            scheduled.append(ScheduledRequest(f"d{i}", [5], CONTEXT, table, True, params, [5] * CONTEXT, [1]))
        plan = SchedulerOutput(scheduled)
        seconds = timed(device, lambda plan=plan: runner.execute(plan), 5)
        eager_seconds = timed(device, lambda plan=plan: eager.execute(plan), 5)
        (_, logits), (_, reference) = runner.compute_logits(plan), eager.compute_logits(plan)
        assert logits is not None and reference is not None
        difference = float((logits - reference).abs().max() / reference.abs().max())
        read = weight_bytes + batch * CONTEXT * kv_token_bytes
        lines.append(f"| decode batch {batch} | {batch / seconds:.0f} | {seconds * 1e3:.2f} | "
                     f"{read / seconds / 1e9:.0f} GB/s = {read / seconds / 1e9 / bandwidth:.0%} | "
                     f"{batch / eager_seconds:.0f} | {eager_seconds / seconds:.2f}x | {difference:.1e} |")
    for length in args.prompts:
        table = list(range(-(-length // 16)))
        prompt = [(j * 7) % 500 + 3 for j in range(length)]
        plan = SchedulerOutput([ScheduledRequest("p", prompt, 0, table, True, params, prompt, [])])
        seconds = timed(device, lambda plan=plan: runner.execute(plan), 3)
        flops = 2 * length * weight_count  # ~2 FLOPs per weight per token (attention not counted)
        lines.append(f"| prefill {length} | {length / seconds:.0f} | {seconds * 1e3:.1f} | "
                     f"~{flops / seconds / 1e12:.1f} TFLOP/s (weights only) | | | |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
