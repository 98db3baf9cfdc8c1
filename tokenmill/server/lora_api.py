"""The server's adapters (vLLM's flags and endpoints): `--lora-modules` at start-up, a request picks one by its
`model` field, `/v1/models` lists them with their parent, and with `--enable-runtime-lora-updating`
`POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` change the set while serving, for paths under
`--lora-dir` only (a client never makes the server read an arbitrary file)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from tokenmill.config import ModelConfig
from tokenmill.lora.request import LoRAError, LoRARequest
from tokenmill.server.errors import APIError


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None  # a several-model server: the model the adapter belongs to


def parse_lora_modules(values: list[str]) -> list[LoRAModule]:
    """`--lora-modules` entries: `name=path`, or vLLM's JSON form `{"name": ..., "path": ...,
    "base_model_name": ...}` (the base model optional where the server serves one)."""
    modules = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
                base = spec.get("base_model_name")
                modules.append(LoRAModule(str(spec["name"]), str(spec["path"]), None if base is None else str(base)))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"--lora-modules {value!r}: expected {{\"name\": ..., \"path\": ...}}") from exc
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {value!r}: expected name=path")
        modules.append(LoRAModule(name, path))
    return modules


class LoadLoRARequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


class LoRARegistry:
    """Adapter name -> LoRARequest. Each (re)load gets a new id, so a name reloaded from another path never
    meets the previous weights in an engine's caches."""

    def __init__(self, base_model: str, model_config: ModelConfig, max_lora_rank: int,
                 lora_dir: str | None = None) -> None:
        self.base_model = base_model
        self.model_config = model_config
        self.max_lora_rank = max_lora_rank
        self.lora_dir = None if lora_dir is None else Path(lora_dir).resolve()
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def add(self, name: str, path: str) -> LoRARequest:
        """Check the adapter against the model (its config and every tensor's shape) and register it."""
        if name == self.base_model:
            raise LoRAError(f"the adapter name {name!r} is the base model's")
        if name in self.adapters:
            raise LoRAError(f"the LoRA adapter {name!r} has already been loaded")
        request = LoRARequest(name, next(self._ids), str(Path(path).resolve()))
        from tokenmill.lora.adapter import load_adapter  # torch: imported only where adapters are served

        load_adapter(request, self.model_config, self.max_lora_rank)  # raises LoRAError with the reason
        self.adapters[name] = request
        return request

    def remove(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise KeyError(name)

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for a name nobody serves."""
        if model is None or model == self.base_model:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            raise APIError(404, f"the model `{model}` does not exist", "not_found_error", "model")
        return adapter

    def allowed_path(self, path: str) -> str:
        """`path` resolved (symlinks and `..` followed) if it lies under --lora-dir; 403 otherwise."""
        if self.lora_dir is None:
            raise APIError(403, "loading adapters at run time needs --lora-dir (the directory they may come from)",
                           "permission_error", "lora_path")
        resolved = Path(path if os.path.isabs(path) else self.lora_dir / path).resolve()
        if not resolved.is_relative_to(self.lora_dir):
            raise APIError(403, f"lora_path must lie under the server's --lora-dir ({self.lora_dir})",
                           "permission_error", "lora_path")
        return str(resolved)

    def model_cards(self, created: int) -> list[dict[str, Any]]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "tokenmill", "root": lora.lora_path,
                 "parent": self.base_model} for name, lora in self.adapters.items()]


def add_lora_routes(app: FastAPI, registry: LoRARegistry, check_api_key: Any) -> None:
    """The run-time endpoints (only with --enable-runtime-lora-updating, as in vLLM)."""
    lock = asyncio.Lock()  # one load at a time: two loads of one name must not both pass the check

    @app.post("/v1/load_lora_adapter", dependencies=[Depends(check_api_key)])
    async def load_lora_adapter(body: LoadLoRARequest) -> PlainTextResponse:
        path = registry.allowed_path(body.lora_path)
        try:
            async with lock:
                await asyncio.to_thread(registry.add, body.lora_name, path)
        except LoRAError as exc:
            raise APIError(400, str(exc), param="lora_path") from exc
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=[Depends(check_api_key)])
    async def unload_lora_adapter(body: UnloadLoRARequest) -> PlainTextResponse:
        try:
            registry.remove(body.lora_name)
        except KeyError as exc:
            raise APIError(404, f"the LoRA adapter '{body.lora_name}' cannot be found", "not_found_error",
                           "lora_name") from exc
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
