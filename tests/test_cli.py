"""`tokenmill generate`: offline batch inference from JSONL, and a single chat prompt."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_generate_jsonl_batch(tmp_path) -> None:  # noqa: ANN001
    inp, out = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    records = [{"prompt": "The capital of France is"}, {"messages": [{"role": "user", "content": "Say hi"}]},
               {"prompt_token_ids": [504, 3575, 282, 4649, 314]}]
    inp.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.run([sys.executable, "-m", "tokenmill.cli", "generate", "--input", str(inp), "--output",
                           str(out), "--max-tokens", "8", "--num-kv-blocks", "64"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(results) == 3
    assert results[0]["prompt"] == "The capital of France is" and results[0]["generated_text"].startswith(" Paris")
    # the same prompt as text and as token ids gives the same greedy tokens
    assert results[2]["token_ids"] == results[0]["token_ids"]
    assert all(r["finish_reason"] in ("stop", "length") and r["token_ids"] for r in results)
    assert "messages" in results[1] and results[1]["prompt_tokens"] > 10
