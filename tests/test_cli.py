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


def test_serve_front_end_never_imports_torch() -> None:
    """`tokenmill serve` with engine-core processes: the API server reads the model's metadata and tokenizer only
    (start-up time and memory), while each engine core maps torch and answers."""
    import httpx
    import psutil

    from tests.server_utils import live_server

    def maps_torch(pid: int) -> bool:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch_cpu" in f.read()

    with live_server("--max-num-seqs", "2") as server:
        reply = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        front_end = psutil.Process(server.proc.pid)
        assert not maps_torch(front_end.pid)
        children = front_end.children(recursive=True)
        assert any(maps_torch(child.pid) for child in children)  # the engine core (and its fork server)
