"""Load generator for any OpenAI-compatible server: Poisson (or scripted) arrivals, a concurrency cap,
streaming completions, per-request timings."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from typing import Any

import httpx

from tokenmill.bench.stats import RequestResult
from tokenmill.bench.workloads import WorkItem


def arrival_times(items: Sequence[WorkItem], request_rate: float, seed: int) -> list[float]:
    """Seconds after start for each request: the item's scripted offset, else a Poisson process at
    `request_rate` (inf: all at once)."""
    rng = random.Random(seed)
    t = 0.0
    times = []
    for item in items:
        if item.arrival_offset is not None:
            times.append(item.arrival_offset)
            continue
        times.append(t)
        if request_rate != float("inf"):
            t += rng.expovariate(request_rate)
    return times


async def send_one(client: httpx.AsyncClient, model: str, item: WorkItem, token_prompts: bool,
                   extra_body: dict[str, Any]) -> RequestResult:
    body: dict[str, Any] = {
        "model": model,
        "prompt": item.prompt_token_ids if token_prompts else item.prompt,
        "max_tokens": item.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        **extra_body,
    }
    result = RequestResult(ok=False, prompt_tokens=len(item.prompt_token_ids), start=time.perf_counter())
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    result.error = str(data["error"])
                    return result
                now = time.perf_counter()
                result.request_id = result.request_id or data.get("id")
                if data.get("usage"):
                    result.output_tokens = data["usage"]["completion_tokens"]
                    result.prompt_tokens = data["usage"]["prompt_tokens"]
                for choice in data.get("choices", []):
                    # every streamed choice is a token's arrival, also one whose text is still empty (a token
                    # that completes no character yet): vLLM's benchmark counts them the same way
                    if "text" in choice:
                        result.text += choice["text"]
                        chunks += 1
                        result.chunk_times.append(now)
                        if result.ttft is None:
                            result.ttft = now - result.start
        result.e2e = time.perf_counter() - result.start
        result.output_tokens = result.output_tokens or chunks
        result.ok = True
    except httpx.HTTPError as exc:
        result.error = repr(exc)
    return result


async def run_load(base_url: str, model: str, items: Sequence[WorkItem], request_rate: float = float("inf"),
                   max_concurrency: int | None = None, seed: int = 0, api_key: str | None = None,
                   token_prompts: bool = False, extra_body: dict[str, Any] | None = None,
                   progress: bool = True, timeout: float = 600.0) -> tuple[list[RequestResult], float]:
    """Send every item; returns the results (in item order) and the wall-clock duration."""
    times = arrival_times(items, request_rate, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connections = httpx.Limits(max_connections=max(100, max_concurrency or len(items)))
    bar = _bar(len(items)) if progress else None
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, headers=headers, limits=connections) as client:
        start = time.perf_counter()

        async def one(item: WorkItem, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            if limit is None:
                result = await send_one(client, model, item, token_prompts, extra_body or {})
            else:
                async with limit:
                    result = await send_one(client, model, item, token_prompts, extra_body or {})
            if bar:
                bar[0].advance(bar[1])
            return result

        try:
            results = await asyncio.gather(*(one(item, at) for item, at in zip(items, times)))
        finally:
            if bar:
                bar[0].stop()
        return list(results), time.perf_counter() - start


def _bar(total: int):  # noqa: ANN202
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    task = progress.add_task("load", total=total)
    progress.start()
    return progress, task
