"""Deterministic benchmark workloads (by seed): mixed, shared-prefix, long-interference, ShareGPT files."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

from tokenmill.model.tokenizer import Tokenizer

_CORPUS = (
    "The history of computing is a story of layers. Early machines were programmed by rewiring panels; later, "
    "stored programs let the same hardware run many tasks. Compilers turned readable code into instructions, "
    "and operating systems shared one processor among many users by slicing time into small quanta. "
    "Networks then connected machines across rooms, cities and oceans, and the web made documents addressable "
    "from anywhere. Each layer hid the details of the one below while exposing a simpler contract above. "
    "Language models continue the pattern: a transformer reads tokens, attends over what came before, and "
    "predicts what comes next. Serving such models efficiently is a scheduling problem as much as an "
    "arithmetic one, because requests arrive at random times with prompts and answers of very different "
    "lengths. A kitchen offers a useful analogy: orders arrive continuously, some dishes take minutes and "
    "others an hour, and a good chef starts each new order as soon as a burner frees up instead of waiting "
    "for the whole table to finish. Rivers carve valleys over millennia, yet a flood can reshape a bank in a "
    "night; ecosystems adapt to both the slow and the sudden. Mathematics gives names to such patterns: "
    "averages hide tails, and the tail often decides how a system feels to the people who use it. "
)


@dataclass
class WorkItem:
    prompt: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_offset: float | None = None  # seconds after the start, for scripted scenarios


# Prompts are built from spans this long at random offsets: the corpus repeats every ~250 tokens, so longer
# slices would make unrelated prompts share their first KV blocks (and hit the prefix cache) at scale.
_SPAN = 8


class TokenSource:
    """Spans of a natural-text token stream, so prompts look like text to a tokenizer yet share no prefix."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.stream = tokenizer.encode(_CORPUS * 8, add_special_tokens=False)

    def take(self, rng: random.Random, length: int) -> list[int]:
        out: list[int] = []
        while len(out) < length:
            start = rng.randrange(len(self.stream) - _SPAN)
            out += self.stream[start:start + min(length - len(out), _SPAN)]
        return out

    def item(self, rng: random.Random, length: int, max_tokens: int, prefix: list[int] | None = None,
             arrival_offset: float | None = None) -> WorkItem:
        ids = (prefix or []) + self.take(rng, length)
        return WorkItem(self.tokenizer.decode(ids), ids, max_tokens, arrival_offset)


def heavy_tailed(rng: random.Random, low: int, high: int, median: float) -> int:
    """Log-normal (sigma 1) clipped to [low, high]: most outputs short, a few very long."""
    return int(min(high, max(low, round(rng.lognormvariate(math.log(median), 1.0)))))


def mixed(tokenizer: Tokenizer, num_requests: int, seed: int = 0, prompt_range: tuple[int, int] = (32, 512),
          output_range: tuple[int, int] = (8, 512), output_median: float = 48.0) -> list[WorkItem]:
    rng = random.Random(seed)
    source = TokenSource(tokenizer)
    return [source.item(rng, rng.randint(*prompt_range), heavy_tailed(rng, *output_range, output_median))
            for _ in range(num_requests)]


def random_lengths(tokenizer: Tokenizer, num_requests: int, input_len: int, output_len: int,
                   seed: int = 0) -> list[WorkItem]:
    """vLLM's `random` dataset: every request has the same prompt and output length."""
    rng = random.Random(seed)
    source = TokenSource(tokenizer)
    return [source.item(rng, input_len, output_len) for _ in range(num_requests)]


def shared_prefix(tokenizer: Tokenizer, num_requests: int, seed: int = 0, prefix_len: int = 768,
                  question_range: tuple[int, int] = (12, 32), max_tokens: int = 16,
                  num_prefixes: int = 1) -> list[WorkItem]:
    """Long common preambles (system prompts or documents) + short distinct questions; with several
    preambles, each request draws one at random (interleaved, and no fixed rotation a round-robin router could
    fall in step with)."""
    rng = random.Random(seed)
    source = TokenSource(tokenizer)
    preambles = [source.take(rng, prefix_len) for _ in range(num_prefixes)]

    def preamble() -> list[int]:
        return preambles[rng.randrange(num_prefixes)] if num_prefixes > 1 else preambles[0]

    return [source.item(rng, rng.randint(*question_range), max_tokens, prefix=preamble())
            for _ in range(num_requests)]


def long_interference(tokenizer: Tokenizer, seed: int = 0, num_short: int = 4, short_prompt: int = 32,
                      short_output: int = 160, long_prompt: int = 3000, long_output: int = 8,
                      long_arrival: float = 4.0) -> list[WorkItem]:
    """Short streams decoding when a very long prompt arrives `long_arrival` seconds later."""
    rng = random.Random(seed)
    source = TokenSource(tokenizer)
    items = [source.item(rng, short_prompt, short_output, arrival_offset=0.0) for _ in range(num_short)]
    items.append(source.item(rng, long_prompt, long_output, arrival_offset=long_arrival))
    return items


def sharegpt(tokenizer: Tokenizer, path: str, num_requests: int, seed: int = 0,
             max_prompt: int = 1024, max_output: int = 512) -> list[WorkItem]:
    """ShareGPT-format JSON: [{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}]."""
    with open(path) as f:
        data = json.load(f)
    rng = random.Random(seed)
    rng.shuffle(data)
    items = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, answer = turns[0].get("value", ""), turns[1].get("value", "")
        ids = tokenizer.encode(prompt)
        out_len = len(tokenizer.encode(answer))
        if not ids or len(ids) > max_prompt or out_len < 1:
            continue
        items.append(WorkItem(prompt, ids, min(out_len, max_output)))
        if len(items) == num_requests:
            break
    if not items:
        raise ValueError(f"no usable conversations in {path}")
    return items
