"""Several models in one server (`--model NAME=PATH` repeated, or `--model-dir DIR`): each model is a whole
single-model API (server/app.py over engine cores of its own), loaded on its first request and unloaded, the
least recently used idle one first, past `--max-loaded-models`. A request goes to the API its body's `model`
names (an adapter's request goes to its base model's: `--lora-modules` entries name their `base_model_name`);
requests for a model that is loading wait for it (bounded); an unknown model is a 404. A load that would not fit
in the memory left is refused with the reason, and the models already loaded go on."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable, Collection
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from tokenmill.server.errors import APIError
from tokenmill.server.middleware import Receive, Scope, Send, ServerState, error_body

if TYPE_CHECKING:
    from fastapi import FastAPI

    from tokenmill.config import EngineConfig
    from tokenmill.engine.async_engine import AsyncLLM
    from tokenmill.server.app import ServerOptions
    from tokenmill.server.lora_api import LoRAModule
    from tokenmill.server.model_swap import ModelAdmin

logger = logging.getLogger("tokenmill.server")

LOAD_OVERHEAD_BYTES = 512 * 2**20  # a model's processes beyond its weights and KV pool (runtime, buffers)


def models_in_dir(directory: str) -> dict[str, str]:
    """Every GGUF file and Hugging Face model directory (one holding config.json) in `directory`, by name."""
    root = Path(directory)
    if not root.is_dir():
        raise SystemExit(f"--model-dir {directory}: not a directory")
    found = {}
    for path in sorted(root.iterdir()):
        if path.suffix == ".gguf" and path.is_file():
            found[path.name.split(".")[0]] = str(path.resolve())
        elif path.is_dir() and (path / "config.json").exists():
            found[path.name] = str(path.resolve())
    if not found:
        raise SystemExit(f"--model-dir {directory}: no GGUF file or model directory in it")
    return found


def parse_model_specs(specs: list[str]) -> dict[str, str]:
    models = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--model {spec!r}: give NAME=PATH for each of several models")
        if name in models:
            raise SystemExit(f"--model: {name!r} given twice")
        models[name] = path
    return models


def attach_adapters(modules: list[LoRAModule], models: Collection[str]) -> dict[str, str]:
    """Adapter name -> its base model's name. Each adapter names its base (vLLM's JSON form of --lora-modules,
    `base_model_name`), unless one model is served."""
    bases: dict[str, str] = {}
    for module in modules:
        base = module.base_model_name or (next(iter(models)) if len(models) == 1 else None)
        if base is None:
            raise ValueError(f"--lora-modules {module.name}: this server serves several models; name the adapter's "
                             'base model: {"name": ..., "path": ..., "base_model_name": ...}')
        if base not in models:
            raise ValueError(f"--lora-modules {module.name}: its base model {base!r} is not served "
                             f"({', '.join(models)})")
        if module.name in models or module.name in bases:
            raise ValueError(f"--lora-modules {module.name}: the name is already a model's or another adapter's")
        bases[module.name] = base
    return bases


def available_memory() -> int:
    """MemAvailable of /proc/meminfo (bytes): what new processes can take without swapping."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


@dataclass
class LoadedModel:
    """One loaded version of a model."""

    llm: AsyncLLM
    app: FastAPI
    lifespan: AbstractAsyncContextManager[Any]
    path: str
    version: int
    in_flight: int = 0  # HTTP requests inside its app

    async def close(self) -> None:
        await self.lifespan.__aexit__(None, None, None)


@dataclass
class ModelEntry:
    name: str
    path: str
    loaded: LoadedModel | None = None
    loading: asyncio.Task[LoadedModel] | None = None
    last_used: float = field(default_factory=time.monotonic)
    last_error: str | None = None
    versions: list[dict[str, Any]] = field(default_factory=list)  # every version loaded or tried (admin API)

    @property
    def in_flight(self) -> int:
        return self.loaded.in_flight if self.loaded else 0

    @property
    def state(self) -> str:
        return "loaded" if self.loaded else "loading" if self.loading else "on_disk"


class ModelPool:
    def __init__(self, models: dict[str, str], config: EngineConfig, options: ServerOptions,
                 max_loaded: int | None = None, log_level: str = "info", load_timeout_s: float = 600.0,
                 start: Callable[..., AsyncLLM] | None = None) -> None:
        self.entries = {name: ModelEntry(name, path) for name, path in models.items()}
        self.config = config
        self.options = options
        self.adapters = attach_adapters(options.lora_modules, models)  # adapter name -> base model name
        if self.adapters and not config.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        self.max_loaded = max_loaded
        self.log_level = log_level
        self.load_timeout_s = load_timeout_s
        self.fatal_listeners: list[Callable[[BaseException], None]] = []  # the lifecycle's interface
        if start is None:
            from tokenmill.server.app import start_front_end

            start = start_front_end
        self._start = start
        # one engine start or stop at a time: the memory check sees the others done, and engine cores are never
        # started while others stop
        self.lock = asyncio.Lock()

    # ------------------------------------------------------------ what the lifecycle asks of a front end

    @property
    def num_open_requests(self) -> int:
        return sum(e.loaded.llm.num_open_requests for e in self.entries.values() if e.loaded)

    def fail_all(self, exc: BaseException) -> None:
        for entry in self.entries.values():
            if entry.loaded:
                entry.loaded.llm.fail_all(exc)

    # ------------------------------------------------------------ loading

    async def app_for(self, name: str) -> ModelEntry:
        """The entry serving `name` (a model, or an adapter: its base model), loaded."""
        entry = self.entries.get(self.adapters.get(name, name))
        if entry is None:
            raise APIError(404, f"the model `{name}` does not exist (served: "
                           f"{', '.join([*self.entries, *self.adapters])})", "not_found_error", "model")
        entry.last_used = time.monotonic()
        if entry.loaded is None:
            if entry.loading is None:
                entry.loading = asyncio.ensure_future(self._load(entry))
            try:
                await asyncio.wait_for(asyncio.shield(entry.loading), self.load_timeout_s)
            except asyncio.TimeoutError as exc:
                raise APIError(503, f"the model `{name}` is still loading", "service_unavailable") from exc
            except APIError:
                raise
            except Exception as exc:  # noqa: BLE001 - a load failure is the request's answer
                raise APIError(503, f"the model `{name}` failed to load: {exc}", "service_unavailable") from exc
        return entry

    async def _load(self, entry: ModelEntry) -> LoadedModel:
        try:
            async with self.lock:
                await self._make_room()
                self.check_memory(entry)
                logger.info("loading model %s from %s", entry.name, entry.path)
                started = time.monotonic()
                loaded = await self.launch(entry, entry.path, len(entry.versions) + 1)
                entry.loaded, entry.last_error = loaded, None
                entry.versions.append({"version": loaded.version, "path": entry.path, "state": "serving",
                                       "loaded_at": int(time.time())})
                logger.info("model %s loaded in %.1f s", entry.name, time.monotonic() - started)
                return loaded
        except BaseException as exc:
            entry.last_error = str(exc)
            raise
        finally:
            entry.loading = None

    async def launch(self, entry: ModelEntry, path: str, version: int) -> LoadedModel:
        """Version `version` of the model from `path`, started and serving its own app (not yet the entry's)."""
        from tokenmill.server.app import build_app

        options = replace(self.options, served_model_name=entry.name, lora_modules=[
            module for module in self.options.lora_modules if self.adapters[module.name] == entry.name])
        llm = await asyncio.to_thread(self._start, replace(self.config, model=path), options, self.log_level)
        app = build_app(llm, options, ServerState())
        lifespan = app.router.lifespan_context(app)
        await lifespan.__aenter__()
        loaded = LoadedModel(llm, app, lifespan, path, version)
        llm.fatal_listeners.append(lambda exc: self._on_model_death(entry, loaded, exc))
        return loaded

    def check_memory(self, entry: ModelEntry, path: str | None = None) -> None:
        path = path or entry.path
        weights = os.path.getsize(path) if os.path.isfile(path) else sum(
            p.stat().st_size for p in Path(path).glob("*.safetensors"))
        needed = weights + int(self.config.kv_cache_memory_gb * 2**30) + LOAD_OVERHEAD_BYTES
        free = available_memory()
        if needed > free:
            raise APIError(503, f"the model `{entry.name}` needs about {needed / 2**30:.1f} GiB (weights "
                           f"{weights / 2**30:.1f} GiB, KV cache {self.config.kv_cache_memory_gb:g} GiB) and "
                           f"{free / 2**30:.1f} GiB is available: not loaded", "service_unavailable")

    async def _make_room(self) -> None:
        """Unload idle models, least recently used first, until one more fits under --max-loaded-models."""
        if self.max_loaded is None:
            return
        loaded = sorted((e for e in self.entries.values() if e.loaded), key=lambda e: e.last_used)
        while len(loaded) >= self.max_loaded:
            idle = next((e for e in loaded if e.in_flight == 0), None)
            if idle is None:
                raise APIError(503, f"{len(loaded)} models are loaded (--max-loaded-models {self.max_loaded}) and "
                               "all are busy", "service_unavailable")
            await self._unload(idle)
            loaded.remove(idle)

    async def _unload(self, entry: ModelEntry) -> None:
        loaded, entry.loaded = entry.loaded, None
        if loaded is not None:
            logger.info("unloading model %s", entry.name)
            self.set_state(entry, loaded.version, "unloaded")
            await loaded.close()

    def set_state(self, entry: ModelEntry, version: int, state: str, **details: Any) -> None:
        for record in entry.versions:
            if record["version"] == version:
                record.update(state=state, **details)

    def _on_model_death(self, entry: ModelEntry, loaded: LoadedModel, exc: BaseException) -> None:
        logger.error("model %s: its engine died (%r); it loads again on its next request", entry.name, exc)
        if entry.loaded is loaded:
            entry.loaded = None
        self.set_state(entry, loaded.version, "died")
        asyncio.ensure_future(self.close(loaded))

    async def close(self, loaded: LoadedModel) -> None:
        async with self.lock:
            await loaded.close()

    async def shutdown(self) -> None:
        for entry in self.entries.values():
            if entry.loading is not None:
                entry.loading.cancel()
            await self._unload(entry)

    # ------------------------------------------------------------ the pool's own endpoints

    def cards(self) -> dict[str, Any]:
        created = int(time.time())
        paths = {module.name: module.path for module in self.options.lora_modules}
        return {"object": "list", "data": [
            {"id": e.name, "object": "model", "created": created, "owned_by": "tokenmill", "status": e.state}
            | ({"max_model_len": e.loaded.llm.max_model_len} if e.loaded else {})
            | ({"last_error": e.last_error} if e.last_error and not e.loaded else {})
            for e in self.entries.values()] + [
            {"id": name, "object": "model", "created": created, "owned_by": "tokenmill", "root": paths[name],
             "parent": base, "status": self.entries[base].state} for name, base in self.adapters.items()]}

    def metrics(self) -> bytes:
        """Every loaded model's metrics in one exposition (their series carry model_name)."""
        registries = [e.loaded.app.state.metrics.registry for e in self.entries.values() if e.loaded]
        return generate_latest(_Merged(registries))  # type: ignore[arg-type]


class _Merged(Collector):
    """Metric families of several registries, the samples of a family gathered under one name."""

    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self.registries = registries

    def collect(self) -> Any:
        families: dict[str, Any] = {}
        for registry in self.registries:
            for family in registry.collect():
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        return iter(families.values())


class ModelRouterApp:
    """The ASGI app of a several-model server: the pool's /v1/models, /health and /metrics, the admin API
    (server/model_swap.py); every other request to the app of the model its JSON body names."""

    def __init__(self, pool: ModelPool, admin: ModelAdmin | None = None) -> None:
        self.pool = pool
        self.admin = admin

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if method == "GET" and path == "/v1/models":
            await _json(send, 200, self.pool.cards())
            return
        if method == "GET" and path == "/health":
            await _json(send, 200, {"status": "ok", "models": {e.name: e.state for e in self.pool.entries.values()}})
            return
        if method == "GET" and path == "/metrics":
            await _raw(send, 200, self.pool.metrics(), CONTENT_TYPE_LATEST)
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        if path.startswith("/admin/"):
            await self._admin(scope, body, send)
            return
        try:
            requested = json.loads(body).get("model") if body else None
        except (ValueError, AttributeError):
            requested = None
        if not isinstance(requested, str):
            await _json(send, 400, error_body(400, "this server serves several models: name one in `model` ("
                                              + ", ".join(self.pool.entries) + ")", "invalid_request_error",
                                              "model"))
            return
        try:
            entry = await self.pool.app_for(requested)
        except APIError as exc:
            await _json(send, exc.status, error_body(exc.status, exc.message, exc.err_type, exc.param))
            return
        assert entry.loaded is not None
        replayed = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay() -> Any:
            return replayed.pop() if replayed else await receive()

        loaded = entry.loaded  # a swap may replace it meanwhile: this request stays with its version
        loaded.in_flight += 1
        try:
            await loaded.app(scope, replay, send)
        finally:
            loaded.in_flight -= 1
            entry.last_used = time.monotonic()

    async def _admin(self, scope: Scope, body: bytes, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        try:
            if self.admin is None:
                raise APIError(403, "the admin API is off (start the server with --admin-api-key)",
                               "permission_error")
            self.admin.check_key(scope)
            parts = path.strip("/").split("/")
            if method == "GET" and parts == ["admin", "models"]:
                await _json(send, 200, self.admin.listing())
            elif method == "POST" and len(parts) == 4 and parts[:2] == ["admin", "models"] and parts[3] == "reload":
                await _json(send, 200, await self.admin.reload(parts[2], body))
            else:
                raise APIError(404, f"no admin endpoint {method} {path}", "not_found_error")
        except APIError as exc:
            await _json(send, exc.status, error_body(exc.status, exc.message, exc.err_type, exc.param))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.pool.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _json(send: Send, status: int, payload: dict[str, Any]) -> None:
    await _raw(send, status, json.dumps(payload).encode(), "application/json")


async def _raw(send: Send, status: int, body: bytes, content_type: str) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def run_model_pool_server(models: dict[str, str], config: EngineConfig, host: str, port: int,
                          options: ServerOptions, max_loaded: int | None, log_level: str,
                          model_dir: str | None = None, admin_api_key: str | None = None,
                          swap_min_agreement: float = 0.5) -> int:
    """Serve several models until SIGTERM (drain, then exit status 0)."""
    import signal
    import sys

    import uvicorn

    from tokenmill.server.lifecycle import GracefulServer
    from tokenmill.server.middleware import RequestGate

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if max_loaded is not None and max_loaded < 1:
        raise SystemExit("--max-loaded-models must be at least 1")
    state = ServerState()
    try:
        pool = ModelPool(models, config, options, max_loaded, log_level)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    from tokenmill.server.drift import load_probes
    from tokenmill.server.model_swap import ModelAdmin

    # a new version may come from the model directory, or from where the configured models are
    roots = [model_dir] if model_dir else sorted({str(Path(p).parent) for p in models.values()})
    admin = ModelAdmin(pool, admin_api_key, roots, load_probes(options.drift_probe) if options.drift_probe else None,
                       swap_min_agreement)
    app = RequestGate(ModelRouterApp(pool, admin), state, options.max_request_body_bytes)
    logger.info("serving %d models on http://%s:%d, each loaded on its first request%s: %s", len(models), host, port,
                f" (at most {max_loaded} at once)" if max_loaded else "", ", ".join(models))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(state.exit_code))
    server = GracefulServer(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                                           access_log=not options.disable_access_log),
                            state, pool, options.shutdown_timeout)
    server.run()
    return state.exit_code
