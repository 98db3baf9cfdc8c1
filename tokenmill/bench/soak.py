"""`tokenmill bench soak`: a long run at a steady rate with dropped streams and malformed bodies, then checks
that the server held up: no 5xx, every request answered, the engine back to idle, resident memory flat."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from tokenmill.bench.loadgen import _bar, arrival_times
from tokenmill.bench.report import machine_description, write_section
from tokenmill.bench.server_process import live_server
from tokenmill.bench.workloads import _CORPUS, WorkItem
from tokenmill.server.metrics import metric_value

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
IDLE_GAUGES = ("tokenmill:num_requests_running", "tokenmill:num_requests_waiting", "tokenmill:kv_cache_usage_perc")
RSS_METRIC = "process_resident_memory_bytes"
MALFORMED_CASES = ("invalid_json", "body_not_object", "max_tokens_not_int", "missing_prompt", "missing_messages",
                   "temperature_out_of_range", "n_zero", "unknown_model", "empty_messages", "logit_bias_key_not_int")
VALID_OUTCOMES = ("complete", "dropped", "cleanly_failed", "bad")
MALFORMED_OUTCOMES = ("malformed_rejected", "malformed_accepted", "malformed_bad")
_WORDS = _CORPUS.split()
_STOPS = (".", "\n", ",", " the", " and", "!")
_JSON = {"content-type": "application/json"}


@dataclass
class SoakCase:
    """One request to send; the body is raw bytes because malformed ones need not be JSON at all."""

    endpoint: str
    body: bytes
    malformed: str | None = None  # the malformed case's name; None for a valid request
    stream: bool = False
    n: int = 1
    has_stop: bool = False
    drop_after: int | None = None  # SSE events to read before closing the connection on purpose


@dataclass
class CheckResult:
    name: str
    passed: bool
    detail: str


@dataclass
class SoakReport:
    url: str
    num_requests: int
    request_rate: float
    max_concurrency: int
    seed: int
    duration_s: float = 0.0  # first arrival to last answer (the idle wait excluded)
    outcomes: dict[str, int] = field(default_factory=dict)
    status_codes: dict[str, int] = field(default_factory=dict)  # HTTP status (or in-stream error code), all requests
    mix: dict[str, int] = field(default_factory=dict)  # what was sent: malformed, streamed, n>1, stops, planned drops
    malformed_cases: dict[str, dict[str, int]] = field(default_factory=dict)  # case -> status -> count
    rss_warmup_bytes: float | None = None
    rss_end_bytes: float | None = None
    rss_peak_bytes: float | None = None
    idle_wait_s: float = 0.0
    final_gauges: dict[str, float | None] = field(default_factory=dict)
    checks: list[CheckResult] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # the first bad outcomes, for diagnosis

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


@dataclass
class _Result:
    outcome: str
    status: int | None  # HTTP status, or the code of an error event inside a 200 stream; None: no response
    detail: str | None = None


# ------------------------------------------------------------------ the request mix


def _prompt_text(rng: random.Random, words: tuple[int, int]) -> str:
    """The corpus read cyclically from a random word, for a log-uniform number of words: many short prompts,
    some several hundred tokens long."""
    count = round(math.exp(rng.uniform(math.log(words[0]), math.log(words[1]))))
    start = rng.randrange(len(_WORDS))
    return " ".join(_WORDS[(start + k) % len(_WORDS)] for k in range(count))


def _valid_case(rng: random.Random, model: str, max_tokens: tuple[int, int], prompt_words: tuple[int, int],
                drop_share: float) -> SoakCase:
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    n = rng.choices((1, 2, 3), weights=(70, 15, 15))[0]
    text = _prompt_text(rng, prompt_words)
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(*max_tokens), "n": n, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        if rng.random() < 0.3:
            body["messages"].insert(0, {"role": "system", "content": "You are a terse assistant."})
    else:
        body["prompt"] = text
    if rng.random() < 0.5:
        body["temperature"] = 0.0
    else:
        body["temperature"] = round(rng.uniform(0.3, 1.2), 2)
        if rng.random() < 0.7:
            body["seed"] = rng.randrange(2**31)
    has_stop = rng.random() < 0.3
    if has_stop:
        stops = rng.sample(_STOPS, rng.randint(1, 2))
        body["stop"] = stops[0] if len(stops) == 1 and rng.random() < 0.5 else stops
    if rng.random() < 0.2:
        body["ignore_eos"] = True
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    drop_after = rng.randint(1, 5) if stream and rng.random() < drop_share else None
    return SoakCase(CHAT if chat else COMPLETIONS, json.dumps(body).encode(), None, stream, n, has_stop, drop_after)


def malformed_body(name: str, model: str, stream: bool = False) -> tuple[str, bytes]:
    """(endpoint, body) for one malformed case: a valid request with exactly one thing wrong."""
    completion: dict[str, Any] = {"model": model, "prompt": "Hello there", "max_tokens": 4, "stream": stream}
    chat: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "Hello there"}],
                            "max_tokens": 4, "stream": stream}
    cases: dict[str, tuple[str, Any]] = {
        "invalid_json": (COMPLETIONS, b'{"model": "' + model.encode() + b'", "prompt": "unterminated'),
        "body_not_object": (CHAT, [chat]),
        "max_tokens_not_int": (COMPLETIONS, {**completion, "max_tokens": "x"}),
        "missing_prompt": (COMPLETIONS, {k: v for k, v in completion.items() if k != "prompt"}),
        "missing_messages": (CHAT, {k: v for k, v in chat.items() if k != "messages"}),
        "temperature_out_of_range": (CHAT, {**chat, "temperature": 5.0}),
        "n_zero": (COMPLETIONS, {**completion, "n": 0}),
        "unknown_model": (CHAT, {**chat, "model": "no-such-model"}),
        "empty_messages": (CHAT, {**chat, "messages": []}),
        "logit_bias_key_not_int": (COMPLETIONS, {**completion, "logit_bias": {"hello": 5}}),
    }
    endpoint, body = cases[name]
    return endpoint, body if isinstance(body, bytes) else json.dumps(body).encode()


def build_cases(num_requests: int, seed: int, model: str, max_tokens: tuple[int, int] = (4, 32),
                prompt_words: tuple[int, int] = (3, 400), malformed_share: float = 0.1,
                drop_share: float = 0.3) -> list[SoakCase]:
    """The seeded request mix. The first request is the heaviest valid one (longest prompt, n=3, most tokens),
    so buffers sized by the largest request are already allocated when the warm-up memory sample is taken."""
    rng = random.Random(seed)
    heaviest = {"model": model, "prompt": _prompt_text(random.Random(seed), (prompt_words[1], prompt_words[1])),
                "max_tokens": max_tokens[1], "n": 3, "ignore_eos": True}
    cases = [SoakCase(COMPLETIONS, json.dumps(heaviest).encode(), n=3)]
    malformed = rng.randrange(len(MALFORMED_CASES))
    for _ in range(num_requests - 1):
        if rng.random() < malformed_share:
            # Round-robin over the cases from a random one, so even a short run sends each of them.
            name = MALFORMED_CASES[malformed % len(MALFORMED_CASES)]
            malformed += 1
            stream = rng.random() < 0.5  # validation must answer JSON errors before any stream starts
            endpoint, body = malformed_body(name, model, stream)
            cases.append(SoakCase(endpoint, body, malformed=name, stream=stream))
        else:
            cases.append(_valid_case(rng, model, max_tokens, prompt_words, drop_share))
    return cases[:num_requests]


# ------------------------------------------------------------------ judging answers


def _openai_error(raw: bytes) -> dict[str, Any] | None:
    """The `error` object when `raw` is an OpenAI error body, else None."""
    try:
        error = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        return None
    if (isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"]
            and isinstance(error.get("type"), str) and error["type"] and "code" in error):
        return error
    return None


def _judge_malformed(status: int, raw: bytes) -> _Result:
    if 200 <= status < 300:
        return _Result("malformed_accepted", status, f"HTTP {status}: {raw[:120]!r}")
    if 400 <= status < 500 and _openai_error(raw):
        return _Result("malformed_rejected", status)
    return _Result("malformed_bad", status, f"HTTP {status}: {raw[:200]!r}")


def _judge_completion(raw: bytes, n: int) -> _Result:
    try:
        choices = json.loads(raw)["choices"]
    except (ValueError, KeyError, TypeError):
        return _Result("bad", 200, f"malformed response body: {raw[:200]!r}")
    if len(choices) != n or not all(c.get("finish_reason") for c in choices):
        return _Result("bad", 200, f"expected {n} finished choices: {raw[:300]!r}")
    return _Result("complete", 200)


async def _read_stream(response: httpx.Response, case: SoakCase) -> _Result:
    finished: set[int] = set()
    events = 0
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            missing = sorted(set(range(case.n)) - finished)
            if missing:
                return _Result("bad", 200, f"stream ended without a finish_reason for choices {missing}")
            return _Result("complete", 200)
        events += 1
        try:
            chunk = json.loads(line[6:])
        except ValueError:
            return _Result("bad", 200, f"malformed SSE event: {line[:200]}")
        if "error" in chunk:
            # An error after the 200 went out: clean when it is a client-side one, a server failure otherwise.
            code = chunk["error"].get("code") if isinstance(chunk["error"], dict) else None
            status = code if isinstance(code, int) else 500
            return _Result("cleanly_failed" if 400 <= status < 500 else "bad", status,
                           f"error in stream: {line[6:206]}")
        for choice in chunk.get("choices") or []:
            if choice.get("finish_reason"):
                finished.add(choice["index"])
        if case.drop_after is not None and events >= case.drop_after:
            return _Result("dropped", 200)  # leaving the `async with` closes the connection mid-stream
    return _Result("bad", 200, f"stream closed by the server without [DONE] after {events} events")


async def _send(client: httpx.AsyncClient, case: SoakCase) -> _Result:
    try:
        async with client.stream("POST", case.endpoint, content=case.body, headers=_JSON) as response:
            status = response.status_code
            if case.malformed is not None:
                return _judge_malformed(status, await response.aread())
            if status != 200:
                raw = await response.aread()
                if 400 <= status < 500 and _openai_error(raw):
                    return _Result("cleanly_failed", status)  # e.g. 429 queue full, 400 context too long
                return _Result("bad", status, f"HTTP {status}: {raw[:200]!r}")
            if case.stream:
                return await _read_stream(response, case)
            return _judge_completion(await response.aread(), case.n)
    except httpx.TimeoutException as exc:
        return _Result("bad", None, f"timeout: {exc!r}")
    except httpx.HTTPError as exc:
        return _Result("bad", None, f"transport error: {exc!r}")


# ------------------------------------------------------------------ server state


async def _metrics(client: httpx.AsyncClient) -> str:
    response = await client.get("/metrics")
    response.raise_for_status()
    return response.text


async def _rss(client: httpx.AsyncClient) -> float | None:
    try:
        return metric_value(await _metrics(client), RSS_METRIC)
    except httpx.HTTPError:
        return None


async def _wait_idle(client: httpx.AsyncClient, timeout: float) -> tuple[bool, dict[str, float | None], float]:
    """Poll /metrics until running, waiting and KV usage are all 0: (idle, last gauges, seconds waited)."""
    start = time.monotonic()
    gauges: dict[str, float | None] = {}
    while True:
        try:
            text = await _metrics(client)
            gauges = {name: metric_value(text, name) for name in IDLE_GAUGES}
        except httpx.HTTPError:
            gauges = {}
        if gauges and all(v == 0 for v in gauges.values()):
            return True, gauges, time.monotonic() - start
        if time.monotonic() - start > timeout:
            return False, gauges, time.monotonic() - start
        await asyncio.sleep(0.2)


async def _model_name(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


# ------------------------------------------------------------------ the run


async def run_soak_async(url: str, num_requests: int, request_rate: float, max_concurrency: int, seed: int,
                         *, model: str | None = None, api_key: str | None = None,
                         max_tokens: tuple[int, int] = (4, 32), prompt_words: tuple[int, int] = (3, 400),
                         malformed_share: float = 0.1, drop_share: float = 0.3, arrivals: str = "fixed",
                         warmup_fraction: float = 0.1, max_rss_growth: float = 0.10,
                         request_timeout: float = 300.0, idle_timeout: float = 30.0, rss_interval: float = 5.0,
                         progress: bool = False) -> SoakReport:
    if request_rate <= 0 or not math.isfinite(request_rate):
        raise ValueError("request_rate must be a positive finite number (a soak runs at a steady rate)")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    report = SoakReport(url, num_requests, request_rate, max_concurrency, seed)
    # Metrics get their own client so that scrapes never queue behind the request pool.
    async with httpx.AsyncClient(base_url=url, timeout=30.0, headers=headers) as probe:
        model = model or await _model_name(probe)
        cases = build_cases(num_requests, seed, model, max_tokens, prompt_words, malformed_share, drop_share)
        if arrivals == "poisson":
            times = arrival_times([WorkItem("", [], 0)] * len(cases), request_rate, seed)
        else:
            times = [i / request_rate for i in range(len(cases))]
        warm_count = max(1, min(len(cases), round(len(cases) * warmup_fraction)))
        limit = asyncio.Semaphore(max_concurrency)
        pool = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        bar = _bar(len(cases)) if progress else None
        answered = 0
        warm_sample: asyncio.Future[float | None] | None = None
        rss_samples: list[float] = []

        async def sample_rss() -> None:
            while True:
                await asyncio.sleep(rss_interval)
                if (value := await _rss(probe)) is not None:
                    rss_samples.append(value)

        async with httpx.AsyncClient(base_url=url, timeout=request_timeout, headers=headers,
                                     limits=pool) as client:
            start = time.perf_counter()

            async def one(case: SoakCase, at: float) -> _Result:
                nonlocal answered, warm_sample
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                async with limit:
                    result = await _send(client, case)
                answered += 1
                if answered == warm_count:
                    warm_sample = asyncio.ensure_future(_rss(probe))
                if bar:
                    bar[0].advance(bar[1])
                return result

            sampler = asyncio.ensure_future(sample_rss())
            try:
                results = await asyncio.gather(*(one(case, at) for case, at in zip(cases, times)))
            finally:
                sampler.cancel()
                if bar:
                    bar[0].stop()
            report.duration_s = time.perf_counter() - start
        report.rss_warmup_bytes = await warm_sample if warm_sample else None
        idle, report.final_gauges, report.idle_wait_s = await _wait_idle(probe, idle_timeout)
        report.rss_end_bytes = await _rss(probe)
        rss_samples += [v for v in (report.rss_warmup_bytes, report.rss_end_bytes) if v is not None]
        report.rss_peak_bytes = max(rss_samples, default=None)
        try:
            health: int | None = (await probe.get("/health")).status_code
        except httpx.HTTPError:
            health = None
    _tally(report, cases, list(results))
    report.checks = _checks(report, cases, list(results), idle, health, max_rss_growth)
    return report


def run_soak(url: str, num_requests: int, request_rate: float, max_concurrency: int, seed: int,
             **kwargs: Any) -> SoakReport:
    """Drive the server at `url` and check it (see run_soak_async for the keyword arguments)."""
    return asyncio.run(run_soak_async(url, num_requests, request_rate, max_concurrency, seed, **kwargs))


def _tally(report: SoakReport, cases: list[SoakCase], results: list[_Result]) -> None:
    outcomes: Counter[str] = Counter({name: 0 for name in VALID_OUTCOMES + MALFORMED_OUTCOMES})
    statuses: Counter[str] = Counter()
    by_case: dict[str, Counter[str]] = {}
    for case, result in zip(cases, results):
        outcomes[result.outcome] += 1
        status = str(result.status) if result.status is not None else "no response"
        statuses[status] += 1
        if case.malformed is not None:
            by_case.setdefault(case.malformed, Counter())[status] += 1
        if result.detail and len(report.errors) < 20 and result.outcome not in ("malformed_rejected",
                                                                                "cleanly_failed"):
            report.errors.append(f"{case.malformed or case.endpoint}: {result.detail}")
    valid = [c for c in cases if c.malformed is None]
    report.outcomes = dict(outcomes)
    report.status_codes = dict(sorted(statuses.items()))
    report.malformed_cases = {name: dict(sorted(c.items())) for name, c in sorted(by_case.items())}
    report.mix = {
        "valid": len(valid),
        "malformed": len(cases) - len(valid),
        "chat": sum(c.endpoint == CHAT for c in valid),
        "streamed": sum(c.stream for c in valid),
        "n_gt_1": sum(c.n > 1 for c in valid),
        "with_stop": sum(c.has_stop for c in valid),
        "drop_planned": sum(c.drop_after is not None for c in valid),
    }


def _checks(report: SoakReport, cases: list[SoakCase], results: list[_Result], idle: bool, health: int | None,
            max_rss_growth: float) -> list[CheckResult]:
    valid = [r for c, r in zip(cases, results) if c.malformed is None]
    valid_5xx = sum(r.status is not None and r.status >= 500 for r in valid)
    bad = [r for r in valid if r.outcome == "bad"]
    let_through = sorted({c.malformed or "" for c, r in zip(cases, results)
                          if c.malformed is not None and r.outcome != "malformed_rejected"})
    warm, end = report.rss_warmup_bytes, report.rss_end_bytes
    if warm and end:
        growth = end / warm - 1
        rss = CheckResult(f"resident memory growth < {max_rss_growth:.0%} after warm-up", growth < max_rss_growth,
                          f"{warm / 2**20:.0f} MiB -> {end / 2**20:.0f} MiB ({growth:+.1%})")
    else:
        rss = CheckResult(f"resident memory growth < {max_rss_growth:.0%} after warm-up", False,
                          f"{RSS_METRIC} not exposed by /metrics")
    return [
        CheckResult("no 5xx for valid requests", valid_5xx == 0, f"{valid_5xx} of {len(valid)}"),
        CheckResult("every valid request complete, dropped or cleanly failed", not bad,
                    f"{len(bad)} bad" + (f"; first: {bad[0].detail}" if bad else "")),
        CheckResult("malformed bodies get a 4xx OpenAI error", not let_through,
                    "all rejected" if not let_through else "not rejected: " + ", ".join(
                        f"{name} {report.malformed_cases[name]}" for name in let_through)),
        CheckResult("running/waiting/KV back to 0 when idle", idle,
                    f"{report.final_gauges} after {report.idle_wait_s:.1f} s"),
        rss,
        CheckResult("server healthy at the end", health == 200, f"GET /health -> {health}"),
    ]


def format_report(report: SoakReport) -> str:
    o = report.outcomes
    lines = [
        f"soak: {report.num_requests} requests at {report.request_rate:g} req/s (max concurrency "
        f"{report.max_concurrency}) in {report.duration_s:.1f} s",
        f"mix: {report.mix}",
        f"valid: {o.get('complete', 0)} complete, {o.get('dropped', 0)} dropped, "
        f"{o.get('cleanly_failed', 0)} cleanly failed, {o.get('bad', 0)} bad; malformed: "
        f"{o.get('malformed_rejected', 0)} rejected, {o.get('malformed_accepted', 0)} accepted, "
        f"{o.get('malformed_bad', 0)} bad",
        f"status codes: {report.status_codes}",
    ]
    if report.rss_peak_bytes:
        lines.append(f"peak RSS {report.rss_peak_bytes / 2**20:.0f} MiB")
    lines += [f"  [{'PASS' if c.passed else 'FAIL'}] {c.name}: {c.detail}" for c in report.checks]
    lines += [f"  error: {e}" for e in report.errors[:5]]
    lines.append("soak PASSED" if report.passed else "soak FAILED")
    return "\n".join(lines)


# ------------------------------------------------------------------ command line


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="an existing server (default: start one on a free port)")
    parser.add_argument("--server-args", default="", help="extra `tokenmill serve` flags when starting one")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-requests", type=int, default=10000)
    parser.add_argument("--request-rate", type=float, default=10.0, help="arrivals per second")
    parser.add_argument("--arrivals", choices=["fixed", "poisson"], default="fixed",
                        help="fixed intervals or a seeded Poisson process")
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, nargs=2, default=[4, 32], metavar=("LOW", "HIGH"),
                        help="range of max_tokens for valid requests")
    parser.add_argument("--prompt-words", type=int, nargs=2, default=[3, 400], metavar=("LOW", "HIGH"),
                        help="range of prompt lengths in words (log-uniform)")
    parser.add_argument("--malformed-share", type=float, default=0.1)
    parser.add_argument("--drop-share", type=float, default=0.3, help="share of streams closed mid-way")
    parser.add_argument("--warmup-fraction", type=float, default=0.1,
                        help="share of requests answered before the baseline memory sample")
    parser.add_argument("--max-rss-growth", type=float, default=0.10)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--idle-timeout", type=float, default=30.0)
    parser.add_argument("--output", default=None, help="write the JSON report here")
    parser.add_argument("--write-docs", action="store_true", help="write the soak section of docs/BENCHMARKS.md")


def main(args: argparse.Namespace) -> int:
    def soak(url: str) -> SoakReport:
        return run_soak(url, args.num_requests, args.request_rate, args.max_concurrency, args.seed,
                        model=args.model, api_key=args.api_key, max_tokens=tuple(args.max_tokens),
                        prompt_words=tuple(args.prompt_words), malformed_share=args.malformed_share,
                        drop_share=args.drop_share, arrivals=args.arrivals, warmup_fraction=args.warmup_fraction,
                        max_rss_growth=args.max_rss_growth, request_timeout=args.request_timeout,
                        idle_timeout=args.idle_timeout, progress=True)

    if args.url:
        report = soak(args.url)
    else:
        # quiet=False: the server's log goes to this terminal, since an unread pipe would fill up and stall
        # the server over a long run.
        with live_server(*shlex.split(args.server_args), quiet=False) as server:
            report = soak(server.url)
    print(format_report(report))
    if args.write_docs:
        write_section("soak", "\n".join([
            "## Soak (`tokenmill bench soak`)", "",
            f"Machine: {machine_description()}. `tokenmill bench soak --num-requests {args.num_requests} "
            f"--request-rate {args.request_rate:g}` against a fresh `tokenmill serve` (defaults), client on the "
            f"same 2 cores; it ran {report.duration_s / 60:.0f} minutes.", "",
            "```", format_report(report), "```"]))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "func"}, **report.to_json()}, f,
                      indent=1)
    return 0 if report.passed else 1
