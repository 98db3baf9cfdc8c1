"""Agent sessions through the KV tiers under the pool (`tokenmill bench agent-sessions`'s workload).

S sessions x T turns in rounds (sessions shuffled in each), one request at a time: a shared system prompt of 512
tokens, then each turn appends 300-1,500 tokens of tool output and a question; the greedy answer joins the
history. The KV pool holds about a quarter of all the sessions' final histories. tokenmill serve runs with the
tiers off, with host memory (`--kv-offload-memory`), with host memory and disk (`--kv-cache-dir`), and with
memory and disk restarted halfway (stopped by SIGTERM, started again on the same directory). llama-server runs
with as many slots as the same number of KV tokens holds, each session's slot saved after its turn and restored
before the next (`--slot-save-path`). Each engine's own answers grow its histories.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_peers import llamacpp_server  # noqa: E402
from tokenmill.bench.agent_sessions import (  # noqa: E402
    LlamaSlotTurns,
    OpenAITurns,
    SessionRun,
    TurnResult,
    build_sessions,
    summarize_turns,
    turn_order,
)
from tokenmill.bench.report import machine_description, markdown_table, write_section  # noqa: E402
from tokenmill.bench.server_process import live_server  # noqa: E402
from tokenmill.model.tokenizer import Tokenizer  # noqa: E402

BLOCK = 16


def run_tokenmill(model: str, flags: list[str], run: SessionRun, order: list[tuple[int, int]], max_tokens: int,
                  restart_at: int | None = None) -> list[TurnResult]:
    results: list[TurnResult] = []
    parts = [order] if restart_at is None else [order[:restart_at], order[restart_at:]]
    for part in parts:
        with live_server("--model", model, *flags, timeout=600) as server:
            name = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
            results += run.run(OpenAITurns(server.url, name), part, max_tokens)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="a GGUF file (the issue's: Qwen2.5-0.5B Q4_K_M)")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", nargs="*", default=["off", "memory", "memory+disk", "restart", "llama.cpp"])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    tokenizer = Tokenizer.from_path(args.model)
    system, sessions = build_sessions(tokenizer, args.sessions, args.turns, args.seed)
    order = turn_order(args.sessions, args.turns, args.seed)
    # the final histories, answers counted at max_tokens: the pool holds a quarter of them
    final = [len(system) + sum(len(t) + args.max_tokens for t in s.turns) for s in sessions]
    pool_tokens = max(sum(final) // 4, 2 * max(final))  # (and at least two sessions, for small runs)
    pool_blocks = pool_tokens // BLOCK
    base = ["--num-kv-blocks", str(pool_blocks), "--max-model-len", str(max(final) + 256)]
    memory = ["--kv-offload-memory", "4"]
    restart_at = len(order) // 2
    rows, summaries, answers, raw = [], {}, {}, {}
    for config in args.configs:
        run = SessionRun(tokenizer, system, sessions)
        with tempfile.TemporaryDirectory() as directory:
            disk = ["--kv-cache-dir", directory]
            if config == "llama.cpp":
                slot_ctx = max(final) + 256
                slots = max(1, pool_tokens // slot_ctx)
                with tempfile.TemporaryDirectory() as slot_dir, llamacpp_server(args.model, (
                        "-np", str(slots), "-c", str(slots * slot_ctx), "--slot-save-path", slot_dir)) as url:
                    if url is None:
                        print("llama.cpp is not built: skipped")
                        continue
                    results = run.run(LlamaSlotTurns(url, slots), order, args.max_tokens)
                name = f"llama-server, {slots} slots x {slot_ctx} tokens, --slot-save-path"
            else:
                flags = {"off": base, "memory": base + memory, "memory+disk": base + memory + disk,
                         "restart": base + memory + disk}[config]
                results = run_tokenmill(args.model, flags, run, order, args.max_tokens,
                                        restart_at if config == "restart" else None)
                name = {"off": "tokenmill, tiers off", "memory": "tokenmill, --kv-offload-memory 4",
                        "memory+disk": "tokenmill, memory + --kv-cache-dir",
                        "restart": "tokenmill, memory + disk, restarted halfway"}[config]
        summary = summarize_turns(results)
        summaries[config] = summary
        raw[config] = [r.__dict__ for r in results]
        answers[config] = [r.answer for r in sorted(results, key=lambda r: (r.session, r.turn))]
        by_turn = summary["by_turn"]
        after_restart = ""
        if config == "restart":  # each session's first turn after the restart: its resent history from disk
            firsts: dict[int, TurnResult] = {}
            for r in results[restart_at:]:
                firsts.setdefault(r.session, r)
            resent = sum(r.prompt_tokens - len(sessions[r.session].turns[r.turn]) for r in firsts.values())
            after_restart = f"{100 * sum(r.cached_tokens for r in firsts.values()) / resent:.0f}%"
        rows.append([name] + [f"{by_turn[t]['ttft_p50']:.2f} / {by_turn[t]['ttft_p90']:.2f}" for t in by_turn]
                    + [f"{100 * statistics.mean(by_turn[t]['cached_share'] for t in by_turn if t != '1'):.0f}%",
                       f"{summary['total_seconds']:.0f}", after_restart])
        print(rows[-1], flush=True)
    off = summaries.get("off")
    notes = []
    if off:
        for config, summary in summaries.items():
            if config != "off":
                ratio = summary["ttft_p50_from_turn_2"] / off["ttft_p50_from_turn_2"]
                notes.append(f"{config}: TTFT p50 from turn 2 = {ratio:.2f}x tiers off")
    same = [c for c in answers if c not in ("off", "llama.cpp") and answers[c] == answers.get("off")]
    notes.append(f"greedy answers equal to tiers off: {', '.join(same) or 'none'}")
    turns = list(summaries[next(iter(summaries))]["by_turn"]) if summaries else []
    table = markdown_table(["engine"] + [f"turn {t} TTFT p50 / p90 (s)" for t in turns]
                           + ["prompt cached from turn 2", "total (s)", "history read back after the restart"], rows)
    body = (f"## Agent sessions (`python benchmarks/bench_agent_sessions.py`)\n\nMachine: {machine_description()}. "
            f"{' '.join(__doc__.split(chr(10) + chr(10))[1].split())} File: {Path(args.model).name}; "
            f"{args.sessions} sessions x {args.turns} turns, answers up to {args.max_tokens} tokens; pool "
            f"{pool_blocks} blocks ({pool_tokens} tokens) against {sum(final)} tokens of final histories.\n\n"
            f"{table}\n\n" + "".join(f"- {n}\n" for n in notes))
    print(body)
    with open(Path(tempfile.gettempdir()) / "bench_agent_sessions.json", "w") as f:  # every turn, to look into
        json.dump({"summaries": summaries, "turns": raw}, f)
    if not args.no_write:
        write_section("agent_sessions", body)


if __name__ == "__main__":
    main()
