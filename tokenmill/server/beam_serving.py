"""The completions API's beam search (vLLM's `use_beam_search`): every step's beams go to the engine as one-token
requests, side by side with the rest of the traffic; the answer is the best `n` hypotheses of each prompt."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import TYPE_CHECKING, Any

from tokenmill.beam_search import BeamSearch, BeamSearchParams, advance_all, next_step
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.errors import APIError

if TYPE_CHECKING:
    from tokenmill.engine.async_engine import AsyncLLM


async def beam_search_completion(llm: AsyncLLM, response_id: str, model: str, prompts: list[Any],
                                 params: BeamSearchParams, n: int, priority: int,
                                 lora: LoRARequest | None) -> dict[str, Any]:
    """A text_completion body with the `n` best hypotheses of each prompt (choices prompt by prompt)."""
    try:
        token_ids = [llm.processor.tokenize_prompt(p)[1] for p in prompts]
        if any(len(ids) + params.max_tokens > llm.max_model_len for ids in token_ids):
            raise ValueError(f"This model's maximum context length is {llm.max_model_len} tokens: a prompt and "
                             f"max_tokens {params.max_tokens} do not fit")
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    searches = [BeamSearch(ids, params, llm.processor.eos_token_ids) for ids in token_ids]
    ids = itertools.count()

    async def alternatives(sequence: list[int], count: int) -> dict[int, float]:
        step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=count, ignore_eos=True)
        last = None
        async for output in llm.generate(f"{response_id}-beam-{next(ids)}", {"prompt_token_ids": sequence}, step,
                                         priority, lora):
            last = output
        logprobs = None if last is None else last.outputs[0].logprobs
        if not logprobs or last is None or last.outputs[0].finish_reason == "abort":
            raise APIError(503, "a beam search step was aborted", "service_unavailable")
        return logprobs[0]

    while True:
        live, sequences, count = next_step(searches)
        if not live:
            break
        advance_all(live, await asyncio.gather(*(alternatives(s, count) for s in sequences)))
    choices: list[dict[str, Any]] = []
    for search in searches:
        for sequence in search.result()[:n]:
            choices.append({"index": len(choices), "text": llm.tokenizer.decode(sequence.tokens), "logprobs": None,
                            "finish_reason": "stop" if sequence.finished else "length", "stop_reason": None})
    prompt_tokens = sum(len(ids) for ids in token_ids)
    completion_tokens = sum(len(s.tokens) for search in searches for s in search.result()[:n])
    return {"id": response_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                          "total_tokens": prompt_tokens + completion_tokens}}
