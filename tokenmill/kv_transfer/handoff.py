"""The front end's side of prefill/decode disaggregation: what a prefill engine and a decode engine are given
for one request, and the hand-offs in flight while requests move from one to the other."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from tokenmill.core.outputs import EngineCoreOutput
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams


@dataclass
class Handoff:
    """An engine request on its way from a prefill engine to a decode engine."""

    request: Request  # the front end's copy
    producer: int | None = None  # the prefill engine holding its saved KV
    decode_at: int | None = None  # the decode engine it was sent to (-1: held until one is up)
    prefill_done: float = 0.0
    kv_transfer_params: dict[str, Any] | None = None  # where the prefill engine saved the prompt's KV
    released: bool = False  # the prefill engine was told to drop the saved KV
    # prompt logprobs the prefill engine computed, for the decode engine's first output (which has none)
    prompt_logprobs: list[dict[int, float]] | None = None


def prefill_copy(child: Request) -> Request:
    """What a prefill engine runs: the prompt, one token, and a request to save the prompt's KV."""
    # Its token is dropped (the decode engine samples the first one), so how it samples does not matter.
    # The prompt's logprobs are computed here, where the prompt is.
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=child.sampling_params.prompt_logprobs)
    prefill = Request(child.request_id, child.prompt_token_ids, params, child.eos_token_ids, child.times.arrival,
                      child.priority, child.prompt)
    prefill.max_total_tokens = child.num_prompt_tokens + 1
    prefill.cache_salt = child.cache_salt
    prefill.user_cache_salt = child.user_cache_salt
    prefill.kv_transfer_params = {"do_remote_decode": True}
    return prefill


def decode_copy(child: Request, kv_transfer_params: dict[str, Any]) -> Request:
    """What a decode engine runs: the whole request, with where the prompt's KV waits."""
    decode = Request(child.request_id, child.prompt_token_ids, replace(child.sampling_params, prompt_logprobs=None),
                     child.eos_token_ids, child.times.arrival, child.priority, child.prompt)
    decode.max_total_tokens = child.max_total_tokens
    decode.cache_salt = child.cache_salt
    decode.user_cache_salt = child.user_cache_salt
    decode.kv_transfer_params = kv_transfer_params
    return decode


class Engine(Protocol):
    """What the hand-offs need of a replica: its state and a command channel."""

    state: str

    def send(self, kind: str, payload: Any) -> int: ...


class Handoffs:
    """Engine requests between a prefill engine and a decode engine, from submission until their stream closes:
    a finished prompt goes on to a decode engine with where its KV is, and the prefill engine is told to drop
    the saved KV once the decode engine has it (or no longer needs it)."""

    def __init__(self, engines: Sequence[Engine], submit_decode: Callable[[Request], int],
                 is_open: Callable[[str], bool], discard_later: Callable[[str], None]) -> None:
        self.engines = engines
        self.submit_decode = submit_decode  # routes to a decode engine; returns its index
        self.is_open = is_open  # the front end still streams this engine request
        self.discard_later = discard_later  # removes a shared-memory KV file off the event loop
        self.inflight: dict[str, Handoff] = {}

    def start(self, children: list[Request]) -> list[Request]:
        """Remember the requests; returns what the prefill engines run."""
        self.inflight.update((child.request_id, Handoff(child)) for child in children)
        return [prefill_copy(child) for child in children]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.inflight

    def from_producer(self, producer: int, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """A prefill engine's outputs: a finished prompt goes on to a decode engine; its token is dropped (the
        decode engine samples the first token itself). Returns the other outputs."""
        kept = []
        for out in outputs:
            handoff = self.inflight.get(out.request_id)
            if handoff is None or handoff.decode_at is not None:
                kept.append(out)
                continue
            if out.kv_transfer_params is None:  # aborted on the prefill engine: nothing to hand over
                continue
            handoff.producer = producer
            handoff.prefill_done = time.monotonic()
            handoff.kv_transfer_params = out.kv_transfer_params
            handoff.prompt_logprobs = out.prompt_logprobs
            if not self.is_open(out.request_id):  # closed meanwhile
                self.engines[producer].send("release", [out.request_id])
                self.inflight.pop(out.request_id, None)
                continue
            handoff.decode_at = self.submit_decode(decode_copy(handoff.request, out.kv_transfer_params))
        return kept

    def from_consumer(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """A decode engine's outputs, the first of each request carrying the prompt logprobs computed where the
        prompt ran."""
        for out in outputs:
            handoff = self.inflight.get(out.request_id)
            if handoff is not None and handoff.prompt_logprobs is not None:
                out.prompt_logprobs, handoff.prompt_logprobs = handoff.prompt_logprobs, None
        return outputs

    def kv_loaded(self, loaded: list[tuple[str, int, float]]) -> list[tuple[str, int, float, float]]:
        """Decode engines have these requests' KV: release it at the producers. Returns (request, bytes,
        transfer seconds, seconds from prefill done to loaded) for the transfer metrics."""
        now = time.monotonic()
        timed = []
        for request_id, nbytes, seconds in loaded:
            handoff = self.inflight.get(request_id)
            timed.append((request_id, nbytes, seconds, now - handoff.prefill_done if handoff is not None else 0.0))
        self.release_kv([request_id for request_id, _, _ in loaded])
        return timed

    def release_kv(self, child_ids: list[str]) -> None:
        """Tell the prefill engines holding these requests' saved KV to drop it."""
        by_producer: dict[int, list[str]] = {}
        for child_id in child_ids:
            handoff = self.inflight.get(child_id)
            if handoff is not None and handoff.producer is not None and not handoff.released:
                handoff.released = True
                by_producer.setdefault(handoff.producer, []).append(child_id)
                params = handoff.kv_transfer_params or {}
                if params.get("transport") == "shm":  # the producer removes it; this, should the producer die
                    self.discard_later(params["path"])
        for index, ids in by_producer.items():
            if self.engines[index].state == "up":
                self.engines[index].send("release", ids)

    def forget(self, child_ids: list[str]) -> None:
        """Their streams are closed: release what the producers still hold, then drop them."""
        self.release_kv(child_ids)
        for child_id in child_ids:
            self.inflight.pop(child_id, None)


def discard(path: str) -> None:
    """Remove a saved request's shared-memory file (a producer that died cannot)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
