"""Load generator for any OpenAI-compatible server: Poisson (or scripted) arrivals, a concurrency cap,
streaming completions, per-request timings."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
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
                   extra_body: dict[str, Any], result: RequestResult | None = None) -> RequestResult:
    """Stream one completion into `result` (a new one if None): what arrived stays there if the task is
    cancelled midway."""
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
    if result is None:
        result = RequestResult(ok=False, prompt_tokens=len(item.prompt_token_ids))
    result.start = time.perf_counter()
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
                   progress: bool = True, timeout: float = 600.0,
                   deadline: float | None = None) -> tuple[list[RequestResult], float]:
    """Send every item; returns the results (in item order) and the wall-clock duration. With a `deadline`
    (seconds after the start), requests still open then are cut (the client disconnects, the server aborts
    them): their results keep what arrived, with ok False and the error saying so."""
    times = arrival_times(items, request_rate, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connections = httpx.Limits(max_connections=max(100, max_concurrency or len(items)))
    bar = _bar(len(items)) if progress else None
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, headers=headers, limits=connections) as client:
        start = time.perf_counter()

        results = [RequestResult(ok=False, prompt_tokens=len(item.prompt_token_ids)) for item in items]

        async def one(item: WorkItem, at: float, result: RequestResult) -> None:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            if limit is None:
                await send_one(client, model, item, token_prompts, extra_body or {}, result)
            else:
                async with limit:
                    await send_one(client, model, item, token_prompts, extra_body or {}, result)
            if bar:
                bar[0].advance(bar[1])

        tasks = [asyncio.ensure_future(one(item, at, result)) for item, at, result in zip(items, times, results)]
        try:
            done, pending = await asyncio.wait(tasks, timeout=deadline)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for task in done:
                task.result()  # a client-side bug surfaces here rather than as a silent failed request
        finally:
            if bar:
                bar[0].stop()
        for result in results:
            if not result.ok and result.error is None:
                result.error = "cut at the deadline"
        return results, time.perf_counter() - start


async def run_closed_loop(base_url: str, model: str, items: Sequence[WorkItem], concurrency: int,
                          token_prompts: bool = True, timeout: float = 600.0) -> ClosedLoop:
    """`concurrency` clients, each sending its next item as soon as its last one finished, until the items run
    out; then the open requests are cut. The load stays at `concurrency` from the start to the last send."""
    queue = list(reversed(items))
    results: list[RequestResult] = []
    sends: list[float] = []
    connections = httpx.Limits(max_connections=max(100, concurrency))
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=connections) as client:
        start = time.perf_counter()
        ran_out = asyncio.Event()

        async def client_loop() -> None:
            while queue:
                item = queue.pop()
                result = RequestResult(ok=False, prompt_tokens=len(item.prompt_token_ids))
                results.append(result)
                sends.append(time.perf_counter())
                if not queue:
                    ran_out.set()  # cut now: a poll would let the other open requests finish meanwhile
                await send_one(client, model, item, token_prompts, {}, result)

        tasks = [asyncio.ensure_future(client_loop()) for _ in range(concurrency)]
        waiter = asyncio.ensure_future(ran_out.wait())
        await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        end = max(sends, default=time.perf_counter())
        for task in tasks:
            task.cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
            raise outcome
    return ClosedLoop(results, sorted(sends), start, end)


@dataclass
class ClosedLoop:
    results: list[RequestResult]  # in send order; the last `concurrency` were cut
    sends: list[float]  # when each request was sent (perf_counter)
    start: float
    end: float  # the last send: the load was full until then

    def output_rate(self, since: float) -> float:
        """Output tokens per second streamed between `since` and the last send."""
        tokens = sum(1 for r in self.results for t in r.chunk_times if since <= t <= self.end)
        return tokens / (self.end - since) if self.end > since else 0.0


def _bar(total: int):  # noqa: ANN202
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    task = progress.add_task("load", total=total)
    progress.start()
    return progress, task
