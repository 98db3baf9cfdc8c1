"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /health, /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncLLM, EngineDeadError, EngineStepError, QueueFullError, RequestStream
from tokenmill.engine.stats_logger import DEFAULT_INTERVAL_S, LoggingStatLogger
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.platform import in_passing_thread
from tokenmill.reasoning import reasoning_parser
from tokenmill.server.anthropic_api import ANTHROPIC_PATH, add_messages_routes, anthropic_error_body
from tokenmill.server.beam_serving import beam_search_completion
from tokenmill.server.cache_salt import request_salt, salted
from tokenmill.server.errors import APIError
from tokenmill.server.lifecycle import GracefulServer, ShuttingDownError
from tokenmill.server.lora_api import LoRAModule, LoRARegistry, add_lora_routes
from tokenmill.server.metrics import EngineMetrics
from tokenmill.server.middleware import RequestGate, ServerState, error_body
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.server.responses import ResponseBuilder, StreamBuilder
from tokenmill.server.responses_api import DEFAULT_STORE_SIZE, ResponseStore, add_responses_routes
from tokenmill.server.serving import Serving, params_or_400
from tokenmill.server.task_routes import refuse_embeddings
from tokenmill.server.tokenizer_api import add_tokenizer_routes
from tokenmill.server.tools import marker_tokens, prepare_conversation, resolve_parser

if TYPE_CHECKING:
    from tokenmill.engine.llm_engine import LLMEngine

logger = logging.getLogger("tokenmill.server")
T = TypeVar("T")


@dataclass
class ServerOptions:
    """The HTTP side's knobs (`tokenmill serve` flags, vLLM's names)."""

    served_model_name: str | None = None
    api_key: str | None = None
    max_request_body_bytes: int = 10 * 1024 * 1024
    request_timeout: float | None = None  # seconds from arrival to the last token; None: no limit
    shutdown_timeout: float = 30.0  # drain on SIGTERM for up to this long
    enable_log_requests: bool = False
    disable_log_stats: bool = False
    # seconds between stats lines; like vLLM's VLLM_LOG_STATS_INTERVAL, an environment variable
    log_stats_interval: float = field(
        default_factory=lambda: float(os.environ.get("TOKENMILL_LOG_STATS_INTERVAL", DEFAULT_INTERVAL_S)))
    disable_access_log: bool = False
    # tool_choice "auto": parse the model's own tool calls (vLLM's flags; tokenmill/tool_parsers, or "auto": the
    # chat template's format)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    tool_call_parser_strict: bool = False  # no lenient reading of loose calls (Qwen2.5's tagless JSON)
    drift_probe: str | None = None  # a file of prompts whose greedy answers are checked against the start's
    drift_probe_interval: float = 10.0  # minutes between drift checks
    drift_logprob_tolerance: float = 1e-3  # a probe logprob further than this from its baseline is drift
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP collector for a span per request (server/tracing.py)
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info: special tokens and the chat template
    responses_store_size: int = DEFAULT_STORE_SIZE  # Responses API: stored responses (LRU) for previous_response_id
    step_trace: str | None = None  # a file for one JSON line per model step (tokenmill sim calibrate reads it)
    data_parallel_size: int = 1  # engine-core processes, each with its own model copy, KV pool and scheduler
    router: str = "prefix-aware"  # which replica gets a request (data parallel)
    distributed_executor_backend: str = "mp"  # where the engine cores run: "mp" (local processes) or "ray"
    disaggregated: str | None = None  # "xPyD": x prefill engines and y decode engines instead of colocated ones
    kv_transport: str = "shm"  # how KV moves between them: "shm" (one host) or "tcp"
    # adapters served from the start (--lora-modules name=path ...; the engine needs --enable-lora)
    lora_modules: list[LoRAModule] = field(default_factory=list)
    enable_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    lora_dir: str | None = None  # the only directory run-time loads may read adapters from
    # whose cache_salt requests get (server/cache_salt.py): "request" (the client's field), "api-key", "header:NAME"
    cache_salt_source: str = "request"


def as_api_error(exc: BaseException) -> APIError:
    """The HTTP error a failed request's stream raised maps to."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineStepError):
        return APIError(500, str(exc), "internal_server_error")
    if isinstance(exc, (EngineDeadError, ShuttingDownError)):
        return APIError(503, str(exc), "service_unavailable")
    if isinstance(exc, asyncio.TimeoutError):
        return APIError(408, "the request timed out before it finished (--request-timeout)", "timeout_error")
    raise exc


def error_response(status: int, message: str, err_type: str = "invalid_request_error", param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, err_type, param), status_code=status, headers=headers)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    param = ".".join(loc) or None
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    return (f"{param}: {message}" if param else message), param


def error_for(request: Request, status: int, message: str, err_type: str = "invalid_request_error",
              param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """The error in the shape of the API the request called."""
    if request.url.path.startswith(ANTHROPIC_PATH):
        return JSONResponse(anthropic_error_body(message, err_type), status_code=status, headers=headers)
    return error_response(status, message, err_type, param, headers)


def add_error_handlers(app: FastAPI) -> None:
    """Validation errors, APIError and HTTP errors answered in each API's own error shape (400 for bad input)."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_for(request, 400, message, param=param)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_for(request, exc.status, exc.message, exc.err_type, exc.param, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_for(request, exc.status_code, str(exc.detail), err_type)


def api_key_check(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """The dependency that refuses a request without the key (None: every request passes)."""

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        # OpenAI clients send a bearer token, Anthropic clients x-api-key
        if request.headers.get("authorization", "") != f"Bearer {api_key}" and \
                request.headers.get("x-api-key") != api_key:
            raise APIError(401, "invalid or missing API key", "authentication_error")

    return check_api_key


class ClientDisconnected(Exception):
    pass


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it if the client goes away first (so the request is aborted)."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    listener = asyncio.ensure_future(wait_disconnect())
    done, _ = await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        listener.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task  # let the work's cleanup (aborting its requests) finish first
    raise ClientDisconnected


def default_model_name(config: EngineConfig) -> str:
    if config.model is None:
        return "SmolLM2-135M-Instruct"
    path = Path(config.model.rstrip("/"))
    return path.stem.split(".")[0] if path.suffix == ".gguf" else path.name


def _lora_registry(llm: AsyncLLM, model_name: str, options: ServerOptions) -> LoRARegistry | None:
    """The adapters this server serves (None: the engine has no LoRA support), --lora-modules checked now."""
    config = llm.config
    if not config.enable_lora:
        if options.lora_modules or options.enable_runtime_lora_updating:
            raise ValueError("--lora-modules and --enable-runtime-lora-updating need --enable-lora")
        return None
    assert llm.processor.model_config is not None
    registry = LoRARegistry(model_name, llm.processor.model_config, config.max_lora_rank, options.lora_dir)
    for module in options.lora_modules:
        try:
            registry.add(module.name, module.path)
        except ValueError as exc:
            raise ValueError(f"--lora-modules {module.name}={module.path}: {exc}") from exc
    return registry


def build_app(llm: AsyncLLM | LLMEngine, options: ServerOptions | None = None,
              state: ServerState | None = None) -> FastAPI:
    """The API over a front end (an engine built in this process is served by one core stepping in a thread)."""
    options = options or ServerOptions()
    state = state or ServerState()
    if not isinstance(llm, AsyncLLM):
        llm = AsyncLLM.from_engine(llm)
    model_name = options.served_model_name or default_model_name(llm.config)
    tokenizer = llm.tokenizer
    loras = _lora_registry(llm, model_name, options)
    metrics = EngineMetrics(model_name)
    metrics.add_replicas(len(llm.replicas))
    for replica in llm.replicas:
        if replica.info is not None:
            metrics.on_cache_config(replica.index, replica.info)
    llm.step_listeners.append(metrics.on_step)
    llm.state_listeners.append(metrics.set_idle)
    llm.replica_listeners.append(lambda r: metrics.on_replica(r.index, r.state, r.restarts))
    llm.route_listeners.append(lambda d: metrics.on_route(d.replica, d.reason, d.matched_blocks))
    llm.transfer_listeners.append(metrics.on_kv_transfer)
    llm.pending_kv_listeners.append(metrics.on_kv_pending)
    llm.migrations.listeners.append(metrics.on_migration)
    if options.step_trace:
        from tokenmill.sim.trace import StepTraceWriter

        llm.step_listeners.append(StepTraceWriter(options.step_trace).on_step)
    stat_logger = LoggingStatLogger()
    if not options.disable_log_stats:
        llm.step_listeners.append(stat_logger.on_step)
        llm.state_listeners.append(stat_logger.on_state)
        llm.migrations.listeners.append(stat_logger.on_migration)

    async def log_stats_forever() -> None:
        while True:
            await asyncio.sleep(options.log_stats_interval)
            stat_logger.log()

    drift = None
    if options.drift_probe:
        from tokenmill.server.drift import DriftMetrics, DriftMonitor, load_probes

        drift = DriftMonitor(llm, load_probes(options.drift_probe), options.drift_probe_interval * 60,
                             DriftMetrics(metrics.registry, model_name), options.drift_logprob_tolerance)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await llm.start()
        # The tokenizer, the model's metadata and the app live as long as the server: out of the collector's
        # sight, a full collection no longer walks them (measured here: 130 ms pauses of every stream without).
        gc.collect()
        gc.freeze()
        stats_task = None if options.disable_log_stats else asyncio.ensure_future(log_stats_forever())
        drift_task = None if drift is None else asyncio.ensure_future(drift.run_forever())
        yield
        for task in (stats_task, drift_task):
            if task is not None:
                task.cancel()
        await llm.shutdown()
        if tracer is not None:
            tracer.shutdown()
        gc.unfreeze()  # a process that goes on (tests, an embedding application) can collect them again

    app = FastAPI(title="tokenmill", lifespan=lifespan)
    app.state.llm = llm
    app.state.metrics = metrics
    app.state.server_state = state
    app.add_middleware(RequestGate, state=state, max_body_bytes=options.max_request_body_bytes)

    add_error_handlers(app)
    check_api_key = api_key_check(options.api_key)

    def check_model(requested: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for one nobody serves."""
        if loras is not None:
            return loras.resolve(requested)
        if requested is not None and requested != model_name:
            raise APIError(404, f"the model `{requested}` does not exist", "not_found_error", "model")
        return None

    @app.get("/health")
    async def health() -> Response:
        """200 "ok" with every engine core up, 200 "degraded" with some, 503 with none (or while draining)."""
        replicas = llm.replica_status()
        if not llm.is_running:
            body = error_body(503, "the engine is not running", "service_unavailable")
            return JSONResponse({**body, "replicas": replicas}, status_code=503)
        if state.draining:
            return error_response(503, "the server is shutting down", "service_unavailable",
                                  headers={"Retry-After": "5"})
        up = sum(r["state"] == "up" for r in replicas)
        return JSONResponse({"status": "ok" if up == len(replicas) else "degraded", "replicas": replicas})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(check_api_key)])
    async def models() -> dict[str, Any]:
        created = int(time.time())
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "tokenmill",
            "max_model_len": llm.max_model_len,
        }] + ([] if loras is None else loras.model_cards(created))}

    def submit(request_id: str, prompt: Any, params: Any, priority: int, lora: LoRARequest | None) -> RequestStream:
        try:
            return llm.add_request(request_id, prompt, params, priority, strict_max_tokens=True, lora_request=lora)
        except QueueFullError as exc:
            raise APIError(429, str(exc), "rate_limit_exceeded", headers={"Retry-After": "1"}) from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "service_unavailable") from exc
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    tracer = None
    if options.otlp_traces_endpoint:
        from tokenmill.server.tracing import RequestTracer

        tracer = RequestTracer(options.otlp_traces_endpoint)

    def on_finished(endpoint: str, request_id: str, output: RequestOutput, lora: LoRARequest | None,
                    trace_context: Any = None) -> None:
        metrics.on_finished(output, endpoint, None if lora is None else lora.lora_name)
        if tracer is not None:
            tracer.on_finished(output, endpoint, model_name if lora is None else lora.lora_name, trace_context)
        if options.enable_log_requests:
            reasons = ",".join(str(c.finish_reason) for c in output.outputs)
            generated = sum(len(c.token_ids) for c in output.outputs)
            logger.info("finished request %s (%s): %s, %d prompt + %d generated tokens", request_id, endpoint,
                        reasons, len(output.prompt_token_ids), generated)

    async def serve(builder: StreamBuilder, prompts: list[Any], params: Any, priority: int, stream: bool,
                    http_request: Request, lora: LoRARequest | None = None) -> Response:
        # Submit every prompt before awaiting any, closing them all if one is rejected. Engine request ids
        # derive from the response id (so from X-Request-Id), made unique if a client reuses one.
        streams: list[RequestStream] = []
        salt = request_salt(options.cache_salt_source, http_request, getattr(http_request.state, "cache_salt", None))
        try:
            for i, prompt in enumerate(map(lambda p: salted(p, salt), prompts)):
                request_id = f"{builder.response_id}-{i}"
                if llm.has_request(request_id):
                    request_id += "-" + uuid.uuid4().hex[:8]
                streams.append(submit(request_id, prompt, params, priority, lora))
        except APIError as exc:
            for s in streams:
                s.close()
            if exc.status >= 500 or options.enable_log_requests:
                logger.info("rejected request %s: %d %s", builder.response_id, exc.status, exc.message)
            raise
        if options.enable_log_requests:
            for s in streams:
                logger.info("received request %s: %d prompt tokens, %s", s.request_id,
                            len(s.children[0].prompt_token_ids), params)
        deadline = None if options.request_timeout is None else time.monotonic() + options.request_timeout
        endpoint = http_request.url.path
        trace_context = None if tracer is None else tracer.context_from(http_request.headers)
        merged = _merge(streams, lambda request_id, output: on_finished(endpoint, request_id, output, lora,
                                                                        trace_context), deadline)
        if stream:
            return StreamingResponse(_sse(builder, merged), media_type="text/event-stream")

        async def collect() -> dict[str, Any]:
            async for index, output in merged:
                builder.update(index, output)
            return builder.final()

        try:
            return JSONResponse(await run_until_disconnect(http_request, collect()))
        except ClientDisconnected:
            await merged.aclose()  # type: ignore[attr-defined]
            return Response(status_code=499)
        except Exception as exc:
            err = as_api_error(exc)
            logger.warning("request %s failed: %d %s", builder.response_id, err.status, err.message)
            raise err from exc

    @app.post("/v1/completions", dependencies=[Depends(check_api_key)])
    async def completions(body: CompletionRequest, http_request: Request) -> Response:
        lora = check_model(body.model)
        if body.use_beam_search:
            response_id = "cmpl-" + (http_request.state.request_id or uuid.uuid4().hex)
            return JSONResponse(await beam_search_completion(
                llm, response_id, serving.served_name(lora), body.prompts(), body.beam_search_params(), body.n,
                body.priority, lora))
        params = params_or_400(lambda: body.sampling_params(body.engine_max_tokens, body.logprobs, body.constraint(),
                                                      body.scored_prompt_logprobs))
        if body.best_of is not None and body.best_of > body.n:  # best_of samples, the n most likely returned
            params = replace(params, n=body.best_of, logprobs=params.logprobs or 0)
        prompts = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in body.prompts()]
        builder = ResponseBuilder("completion", serving.served_name(lora), tokenizer, len(prompts), params.n,
                                  logprobs=body.logprobs, request_id=http_request.state.request_id, echo=body.echo,
                                  drop_generated=body.max_tokens == 0, prompt_logprobs=body.prompt_logprobs,
                                  keep_best=body.n if params.n > body.n else None)
        builder.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        http_request.state.cache_salt = body.cache_salt
        return await serve(builder, prompts, params, body.priority, body.stream, http_request, lora)

    def encode_chat(conversation: list[dict[str, Any]], tools: Sequence[dict[str, Any]],
                    add_generation_prompt: bool = True, add_special_tokens: bool = False) -> list[int]:
        try:
            messages, template_vars = prepare_conversation(conversation, tools, tokenizer.chat_template,
                                                           tool_parser(tools))
            return tokenizer.encode_chat(messages, add_generation_prompt, add_special_tokens=add_special_tokens,
                                         **template_vars)
        except Exception as exc:  # a template that rejects the conversation
            raise APIError(400, f"chat template failed: {exc}", param="messages") from exc

    tool_parser = resolve_parser(options.tool_call_parser, tokenizer.chat_template)
    spell, keep_special_tokens = marker_tokens(tokenizer, tool_parser)
    serving = Serving(model_name, tokenizer, llm.max_model_len, serve, encode_chat,
                      options.enable_auto_tool_choice and options.tool_call_parser is not None, check_api_key,
                      check_model, reasoning_parser(llm.config.reasoning_parser), tool_parser,
                      options.tool_call_parser_strict, spell, keep_special_tokens)
    add_tokenizer_routes(app, serving, options.enable_tokenizer_info_endpoint)
    if loras is not None and options.enable_runtime_lora_updating:
        add_lora_routes(app, loras, check_api_key)
    add_messages_routes(app, serving)
    add_responses_routes(app, serving, ResponseStore(options.responses_store_size))

    @app.post("/v1/chat/completions", dependencies=[Depends(check_api_key)])
    async def chat_completions(body: ChatCompletionRequest, http_request: Request) -> Response:
        lora = check_model(body.model)
        max_tokens = body.max_completion_tokens or body.max_tokens
        top = body.top_logprobs or 0
        tool_mode = body.tool_mode
        serving.check_tool_mode(tool_mode)
        tools = body.tool_definitions()
        named = body.tool_choice.function.name if tool_mode == "named" else None  # type: ignore[union-attr]
        params = serving.with_tools(params_or_400(lambda: body.sampling_params(
            max_tokens, top if body.logprobs else None, serving.tool_constraint(
                tool_mode, tools, named, body.parallel_tool_calls, body.constraint()))), tool_mode)
        prompt_ids = encode_chat(body.conversation(), tools, body.add_generation_prompt)
        builder = ResponseBuilder("chat", serving.served_name(lora), tokenizer, 1, params.n,
                                  logprobs=top if body.logprobs else None, request_id=http_request.state.request_id,
                                  tool_mode=tool_mode, tool_parser=serving.parser_for(tool_mode, tools),
                                  reasoning=serving.reasoning)
        builder.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        http_request.state.cache_salt = body.cache_salt
        return await serve(builder, [{"prompt_token_ids": prompt_ids}], params, body.priority, body.stream,
                           http_request, lora)

    if llm.config.task == "embed":  # an encoder, or a decoder embedding model (last-token pooling), through the
        # scheduler: the embedding endpoints, and generation's refused
        from tokenmill.server.embedding_backends import engine_backend
        from tokenmill.server.embeddings_api import EmbeddingServing, add_embedding_routes

        backend = engine_backend(llm, on_finished=metrics.on_finished)
        add_embedding_routes(app, EmbeddingServing(backend, model_name), check_api_key, check_model)
    else:
        refuse_embeddings(app, model_name, [Depends(check_api_key)])
    return app


async def _merge(streams: list[RequestStream], on_finished: Callable[[str, RequestOutput], None],
                 deadline: float | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several prompts' output streams, tagging each output with its prompt index. Closing the
    merged iterator (or cancelling its consumer) aborts every unfinished request; past `deadline`
    (time.monotonic) it raises asyncio.TimeoutError."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                if output.finished:
                    on_finished(stream.request_id, output)
                await queue.put((index, output))
            await queue.put((index, None))
        except Exception as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((index, exc))
        finally:
            stream.close()

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            if deadline is None:
                index, item = await queue.get()
            else:
                index, item = await asyncio.wait_for(queue.get(), max(0.0, deadline - time.monotonic()))
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


async def _sse(builder: StreamBuilder, merged: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
    try:
        for event in builder.opening_events():
            yield event
        async for index, output in merged:
            for event in builder.delta_events(index, output):
                yield event
        closing = builder.closing_events()
    except Exception as exc:  # the stream has started: the error goes in an event (the API's own shape)
        err = as_api_error(exc)
        logger.warning("request %s failed mid-stream: %d %s", builder.response_id, err.status, err.message)
        closing = builder.error_events(err)
    finally:
        await merged.aclose()  # type: ignore[attr-defined]
    for event in closing:
        yield event


def parse_disaggregated(spec: str) -> tuple[int, int]:
    """"1P1D" -> (1, 1): prefill and decode engine counts."""
    match = re.fullmatch(r"(\d+)P(\d+)D", spec.strip().upper())
    if not match or not int(match.group(1)) or not int(match.group(2)):
        raise ValueError(f"--disaggregated takes xPyD with x, y >= 1 (e.g. 1P1D), got {spec!r}")
    return int(match.group(1)), int(match.group(2))


def multiprocessing_enabled() -> bool:
    """Engine cores in their own processes (the default, as vLLM v1's VLLM_ENABLE_V1_MULTIPROCESSING)."""
    return os.environ.get("TOKENMILL_ENABLE_MULTIPROCESSING", "1") != "0"


def start_front_end(config: EngineConfig, options: ServerOptions, log_level: str = "info") -> AsyncLLM:
    """Load the engine cores (blocking) and return the front end over them."""
    if options.disaggregated:
        if options.distributed_executor_backend != "mp" or not multiprocessing_enabled():
            raise ValueError("--disaggregated runs its engines as local processes (--distributed-executor-backend mp)")
        num_prefill, num_decode = parse_disaggregated(options.disaggregated)
        return AsyncLLM.launch_disaggregated(config, num_prefill, num_decode, options.kv_transport, options.router,
                                             bool(options.step_trace), log_level)
    if options.distributed_executor_backend == "ray":
        from tokenmill.engine.ray_backend import launch_on_ray

        return launch_on_ray(config, options.data_parallel_size, options.router, bool(options.step_trace),
                             log_level)
    if options.distributed_executor_backend != "mp":
        raise ValueError(f"unknown --distributed-executor-backend {options.distributed_executor_backend!r}: "
                         "mp or ray")
    if multiprocessing_enabled():
        return AsyncLLM.launch(config, options.data_parallel_size, options.router, bool(options.step_trace),
                               log_level)
    if options.data_parallel_size > 1:
        raise ValueError("--data-parallel-size > 1 needs engine-core processes (TOKENMILL_ENABLE_MULTIPROCESSING=1)")
    # The engine steps in a thread of this process: load the model in a passing thread, so that the engine
    # thread's OpenMP team is the only one alive while serving (see platform.in_passing_thread). Imported here:
    # with engine-core processes (the default) this process never imports the engine, nor torch.
    from tokenmill.engine.llm_engine import LLMEngine

    return AsyncLLM.from_engine(in_passing_thread(lambda: LLMEngine.from_config(config)))


def run_server(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000,
               options: ServerOptions | None = None, log_level: str = "info") -> int:
    """Serve until SIGTERM (drain, then exit status 0) or until no engine core is left (exit status 1)."""
    import uvicorn

    options = options or ServerOptions()
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    llm = start_front_end(config, options, log_level)
    state = ServerState()
    app = build_app(llm, options, state)
    for replica in llm.replicas:
        info = replica.info
        assert info is not None
        logger.info("engine core %d (pid %d%s): KV cache %s, %d blocks x %d tokens = %d tokens (%.0f MiB)%s",
                    replica.index, info.pid, f", CPUs {info.cpus}" if info.cpus else "", info.kv_cache_dtype,
                    info.num_kv_blocks, info.block_size, info.num_kv_blocks * info.block_size,
                    info.kv_cache_bytes / 2**20,
                    f", started in {info.start_seconds:.1f} s, RSS {info.rss_bytes / 2**20:.0f} MiB"
                    if info.rss_bytes else "")
    logger.info("serving %s on http://%s:%d (%d engine core%s, router %s, ready in %.1f s): max_model_len %d, "
                "max_num_seqs %d, max_num_batched_tokens %d",
                options.served_model_name or default_model_name(config), host, port, len(llm.replicas),
                "s" if len(llm.replicas) > 1 else "", options.router if len(llm.replicas) > 1 else "-",
                time.monotonic() - started, llm.max_model_len, llm.config.max_num_seqs,
                llm.config.max_num_batched_tokens)
    # A SIGTERM before uvicorn's handlers are in place (or one it re-raises as it exits) ends the process cleanly.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(state.exit_code))
    server = GracefulServer(
        uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                       access_log=not options.disable_access_log),
        state, app.state.llm, options.shutdown_timeout)
    server.run()
    return state.exit_code
