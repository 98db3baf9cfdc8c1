"""The front end's side of prefill/decode disaggregation: what a prefill engine and a decode engine are given
for one request, and what the front end remembers while the request moves from one to the other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams


@dataclass
class Handoff:
    """An engine request on its way from a prefill engine to a decode engine."""

    request: Request  # the front end's copy
    producer: int | None = None  # the prefill engine holding its saved KV
    decode_at: int | None = None  # the decode engine it was sent to
    prefill_done: float = 0.0
    kv_transfer_params: dict[str, Any] | None = None  # where the prefill engine saved the prompt's KV
    released: bool = False  # the prefill engine was told to drop the saved KV


def prefill_copy(child: Request) -> Request:
    """What a prefill engine runs: the prompt, one token, and a request to save the prompt's KV."""
    # Its token is dropped (the decode engine samples the first one), so how it samples does not matter.
    prefill = Request(child.request_id, child.prompt_token_ids, SamplingParams(max_tokens=1, temperature=0.0),
                      child.eos_token_ids, child.times.arrival, child.priority, child.prompt)
    prefill.max_total_tokens = child.num_prompt_tokens + 1
    prefill.cache_salt = child.cache_salt
    prefill.kv_transfer_params = {"do_remote_decode": True}
    return prefill


def decode_copy(child: Request, kv_transfer_params: dict[str, Any]) -> Request:
    """What a decode engine runs: the whole request, with where the prompt's KV waits."""
    decode = Request(child.request_id, child.prompt_token_ids, child.sampling_params, child.eos_token_ids,
                     child.times.arrival, child.priority, child.prompt)
    decode.max_total_tokens = child.max_total_tokens
    decode.cache_salt = child.cache_salt
    decode.kv_transfer_params = kv_transfer_params
    return decode
