"""The HTTP server of `tokenmill serve MODEL --task embed`: the embedding engine in this process (its batching
thread), /v1/embeddings, /rerank and /score (server/embeddings_api.py), /v1/models, /health, /metrics and
/tokenize, with the generative server's auth, errors and body limit."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily
from pydantic import BaseModel, ConfigDict

from tokenmill.config import EngineConfig
from tokenmill.encoder.engine import EmbeddingEngine
from tokenmill.server.app import (
    ServerOptions,
    add_error_handlers,
    api_key_check,
    default_model_name,
    error_response,
)
from tokenmill.server.embedding_backends import EncoderBackend
from tokenmill.server.embeddings_api import EmbeddingServing, add_embedding_routes
from tokenmill.server.errors import APIError
from tokenmill.server.middleware import RequestGate, ServerState

logger = logging.getLogger("tokenmill.server")


class _EmbeddingCollector:
    """The engine's counters, read at each scrape."""

    def __init__(self, embedder: EmbeddingEngine, model_name: str) -> None:
        self.embedder = embedder
        self.model_name = model_name

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self.embedder.stats
        for name, documentation, value in (
                ("embedding_requests", "Embedding, rerank and score requests served", stats.requests),
                ("embedding_inputs", "Inputs (texts, pairs) encoded", stats.inputs),
                ("embedding_prompt_tokens", "Tokens encoded", stats.tokens),
                ("embedding_batches", "Batches run (one model pass each)", stats.batches),
                ("embedding_batch_seconds", "Seconds spent running batches", stats.seconds)):
            family = CounterMetricFamily(f"tokenmill:{name}", documentation, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str


def build_embedding_app(embedder: EmbeddingEngine, options: ServerOptions | None = None,
                        state: ServerState | None = None, model_name: str | None = None) -> FastAPI:
    options = options or ServerOptions()
    state = state or ServerState()
    name = options.served_model_name or model_name or default_model_name(EngineConfig(model=embedder.path))
    registry = CollectorRegistry()
    registry.register(_EmbeddingCollector(embedder, name))  # type: ignore[arg-type]

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        embedder.start()
        yield
        embedder.shutdown()

    app = FastAPI(title="tokenmill embeddings", lifespan=lifespan)
    app.state.embedder = embedder
    app.state.server_state = state
    app.add_middleware(RequestGate, state=state, max_body_bytes=options.max_request_body_bytes)

    add_error_handlers(app)
    check_api_key = api_key_check(options.api_key)

    def check_model(requested: str | None) -> None:
        if requested is not None and requested != name:
            raise APIError(404, f"the model `{requested}` does not exist", "not_found_error", "model")

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return error_response(503, "the server is shutting down", "service_unavailable",
                                  headers={"Retry-After": "5"})
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(check_api_key)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "tokenmill", "max_model_len": embedder.max_model_len}]}

    @app.post("/tokenize", dependencies=[Depends(check_api_key)])
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        tokens, _ = embedder.tokenizer.encode(body.prompt)
        return {"count": len(tokens), "max_model_len": embedder.max_model_len, "tokens": tokens}

    add_embedding_routes(app, EmbeddingServing(EncoderBackend(embedder), name), check_api_key, check_model)
    return app


def run_embedding_server(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000,
                         options: ServerOptions | None = None, log_level: str = "info") -> int:
    """Serve until SIGTERM or SIGINT: uvicorn stops taking connections and lets in-flight requests finish."""
    import uvicorn

    options = options or ServerOptions()
    unsupported = [flag for flag, used in (
        ("--data-parallel-size", options.data_parallel_size > 1), ("--disaggregated", bool(options.disaggregated)),
        ("--distributed-executor-backend ray", options.distributed_executor_backend == "ray"),
        ("--enable-lora / --lora-modules", config.enable_lora or bool(options.lora_modules)),
        ("--speculative-config", config.speculative_config is not None)) if used]
    if unsupported:
        raise ValueError(f"an encoder served for embeddings runs in the API process: {', '.join(unsupported)} "
                         "do not apply to it")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    embedder = EmbeddingEngine(config)
    app = build_embedding_app(embedder, options)
    logger.info("serving embeddings of %s on http://%s:%d (ready in %.1f s)",
                options.served_model_name or default_model_name(config), host, port, time.monotonic() - started)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=int(options.shutdown_timeout),
                                           access_log=not options.disable_access_log))
    server.run()
    return 0
