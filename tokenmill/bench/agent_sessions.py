"""`tokenmill bench agent-sessions`: multi-turn agents resending a growing history.

S sessions x T turns, in rounds: each round runs every session's next turn, sessions in a shuffled order, one
request at a time. A session starts with the system prompt all sessions share (tool definitions and
instructions); each turn appends a "tool output" of 300-1,500 tokens and a question, and the answer (greedy, up
to `max_tokens`) joins the history before the next turn. Between two turns of a session every other session
runs one turn, so a pool that holds a quarter of the sessions has evicted it by then: what a turn's first
token waits for is whether its history is still somewhere (the pool, a KV tier, a saved slot) or is prefilled
again.

Clients: any OpenAI-compatible server (`/v1/completions`, streamed, `usage.prompt_tokens_details.cached_tokens`)
and llama.cpp's llama-server with `--slot-save-path` (a slot per session restored before its turn and saved
after it, the way an agent framework keeps llama.cpp sessions; the restore counts in the turn's TTFT).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from tokenmill.bench.stats import percentiles
from tokenmill.bench.workloads import TokenSource
from tokenmill.model.tokenizer import Tokenizer

QUESTION = " Given the tool output above, what should the next step be? Answer briefly."


@dataclass
class Session:
    turns: list[list[int]]  # each turn's new tokens: a tool output and the question


@dataclass
class TurnResult:
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int  # as the server reports it
    ttft: float
    e2e: float
    answer: str


def build_sessions(tokenizer: Tokenizer, num_sessions: int, num_turns: int, seed: int,
                   append_range: tuple[int, int] = (300, 1500), system_tokens: int = 512) -> tuple[list[int],
                                                                                                   list[Session]]:
    """(the shared system prompt, the sessions), deterministic in `seed`."""
    rng = random.Random(seed)
    source = TokenSource(tokenizer)
    system = source.take(rng, system_tokens)
    question = tokenizer.encode(QUESTION, add_special_tokens=False)
    sessions = [Session([source.take(rng, rng.randint(*append_range)) + question for _ in range(num_turns)])
                for _ in range(num_sessions)]
    return system, sessions


def turn_order(num_sessions: int, num_turns: int, seed: int) -> list[tuple[int, int]]:
    """(session, turn) in rounds, the sessions shuffled in each."""
    rng = random.Random(seed + 1)
    order: list[tuple[int, int]] = []
    for turn in range(num_turns):
        sessions = list(range(num_sessions))
        rng.shuffle(sessions)
        order.extend((session, turn) for session in sessions)
    return order


class TurnClient(Protocol):
    def turn(self, session: int, prompt: list[int], max_tokens: int) -> tuple[float, float, int, str]:
        """(TTFT, end-to-end seconds, cached prompt tokens, answer text) of one greedy completion."""
        ...


class OpenAITurns:
    def __init__(self, base_url: str, model: str, timeout: float = 900.0) -> None:
        self.client = httpx.Client(base_url=base_url, timeout=timeout)
        self.model = model

    def turn(self, session: int, prompt: list[int], max_tokens: int) -> tuple[float, float, int, str]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        ttft, cached, text = None, 0, ""
        with self.client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode()[:300]}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                for choice in data.get("choices", []):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text += choice.get("text", "")
                details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
                cached = details.get("cached_tokens", cached) or cached
        return ttft or 0.0, time.perf_counter() - start, cached, text


class LlamaSlotTurns:
    """llama-server with `--slot-save-path`: session s runs in slot s % slots; its saved state is restored into
    the slot before its turn (unless the slot still holds it) and saved after."""

    def __init__(self, base_url: str, slots: int, timeout: float = 900.0) -> None:
        self.base_url = base_url
        self.timeout = timeout
        self.slots = slots
        self.holder: dict[int, int] = {}  # slot -> session whose state it holds
        self.saved: set[int] = set()

    def turn(self, session: int, prompt: list[int], max_tokens: int) -> tuple[float, float, int, str]:
        slot = session % self.slots
        start = time.perf_counter()
        if self.holder.get(slot) != session and session in self.saved:
            self._slot_action(slot, "restore", session)
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "stream": True,
                "cache_prompt": True, "id_slot": slot}
        ttft, cached, text = None, 0, ""
        # a connection each (llama-server closes streamed ones; a reused one fails at random)
        with httpx.stream("POST", self.base_url + "/completion", json=body, timeout=self.timeout) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = json.loads(line[6:])
                if data.get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text += data["content"]
                if data.get("stop"):
                    timings = data.get("timings") or {}
                    cached = int(timings.get("cache_n", data.get("tokens_cached", 0)) or 0)
        end = time.perf_counter()
        self._slot_action(slot, "save", session)
        self.holder[slot] = session
        self.saved.add(session)
        return ttft or end - start, end - start, cached, text


    def _slot_action(self, slot: int, action: str, session: int) -> None:
        httpx.post(f"{self.base_url}/slots/{slot}?action={action}", json={"filename": f"session-{session}.bin"},
                   timeout=self.timeout).raise_for_status()


@dataclass
class SessionRun:
    """The histories as the turns grow them (kept across a server restart)."""
    tokenizer: Tokenizer
    system: list[int]
    sessions: list[Session]
    histories: dict[int, list[int]] = field(default_factory=dict)

    def run(self, client: TurnClient, order: Sequence[tuple[int, int]], max_tokens: int) -> list[TurnResult]:
        results = []
        for session, turn in order:
            history = self.histories.get(session, self.system)
            prompt = history + self.sessions[session].turns[turn]
            ttft, e2e, cached, answer = client.turn(session, prompt, max_tokens)
            self.histories[session] = prompt + self.tokenizer.encode(answer, add_special_tokens=False)
            results.append(TurnResult(session, turn, len(prompt), cached, ttft, e2e, answer))
        return results


def summarize_turns(results: Sequence[TurnResult]) -> dict[str, Any]:
    """TTFT p50/p90 and the share of prompt tokens served from cache, by turn; totals."""
    by_turn: dict[str, Any] = {}
    for turn in sorted({r.turn for r in results}):
        rows = [r for r in results if r.turn == turn]
        ttft = percentiles([r.ttft for r in rows], (50, 90))
        by_turn[str(turn + 1)] = {"ttft_p50": ttft["p50"], "ttft_p90": ttft["p90"],
                                  "cached_share": sum(r.cached_tokens for r in rows) / sum(r.prompt_tokens
                                                                                           for r in rows),
                                  "prompt_tokens_mean": sum(r.prompt_tokens for r in rows) / len(rows)}
    later = [r.ttft for r in results if r.turn > 0]
    return {"by_turn": by_turn, "ttft_p50_from_turn_2": percentiles(later, (50,))["p50"] if later else 0.0,
            "total_seconds": sum(r.e2e for r in results), "turns": len(results)}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name sent to the server (default: its first)")
    parser.add_argument("--tokenizer", default=None, help="GGUF file or HF dir (default: the bundled model)")
    parser.add_argument("--sessions", type=int, default=48)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)


def main(args: argparse.Namespace) -> int:
    from tokenmill.model.loader import resolve_model_path

    tokenizer = Tokenizer.from_path(resolve_model_path(args.tokenizer))
    system, sessions = build_sessions(tokenizer, args.sessions, args.turns, args.seed)
    model = args.model or httpx.get(args.base_url + "/v1/models").json()["data"][0]["id"]
    results = SessionRun(tokenizer, system, sessions).run(OpenAITurns(args.base_url, model),
                                                          turn_order(args.sessions, args.turns, args.seed),
                                                          args.max_tokens)
    summary = summarize_turns(results)
    for turn, row in summary["by_turn"].items():
        print(f"turn {turn}: TTFT p50 {row['ttft_p50']:.3f} s, p90 {row['ttft_p90']:.3f} s, "
              f"{100 * row['cached_share']:.0f}% of {row['prompt_tokens_mean']:.0f} prompt tokens cached")
    print(f"total {summary['total_seconds']:.1f} s over {summary['turns']} turns")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"summary": summary, "turns": [r.__dict__ for r in results]}, f, indent=1)
    return 0
