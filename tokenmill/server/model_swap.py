"""Swapping a model's version under load (`POST /admin/models/{name}/reload`, behind `--admin-api-key`): the new
version loads beside the old one and must answer a probe set (the --drift-probe prompts, or a few fixed ones)
greedily the way the serving version does, to at least `--swap-min-agreement` of the tokens; then new requests
go to it while the old version finishes what it holds, and is closed. A failed load or probe closes the new
version and keeps the old one serving (roll back), with the reason. `GET /admin/models` shows the versions."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from typing import Any

from tokenmill.server.drift import Probe, compare, probe_answers
from tokenmill.server.errors import APIError
from tokenmill.server.middleware import Scope
from tokenmill.server.model_pool import LoadedModel, ModelEntry, ModelPool

logger = logging.getLogger("tokenmill.server")

DEFAULT_PROBES = [Probe("The capital of France is", 8), Probe("def add(a, b):", 8),
                  Probe("List three colors:\n1.", 8)]
DRAIN_POLL_S = 0.05


class ModelAdmin:
    def __init__(self, pool: ModelPool, api_key: str | None, allowed_roots: list[str],
                 probes: list[Probe] | None = None, min_agreement: float = 0.5) -> None:
        self.pool = pool
        self.api_key = api_key
        self.allowed_roots = [os.path.realpath(root) for root in allowed_roots]
        self.probes = probes or DEFAULT_PROBES
        self.min_agreement = min_agreement
        self._swapping: set[str] = set()

    def check_key(self, scope: Scope) -> None:
        if self.api_key is None:
            raise APIError(403, "the admin API is off (start the server with --admin-api-key)", "permission_error")
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"").decode("latin-1").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise APIError(401, "a valid admin API key is required (Authorization: Bearer KEY)",
                           "authentication_error")

    def listing(self) -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": e.name, "status": e.state, "path": e.loaded.path if e.loaded else e.path,
             "version": e.loaded.version if e.loaded else None, "versions": e.versions}
            for e in self.pool.entries.values()]}

    def _allowed(self, path: str) -> str:
        real = os.path.realpath(path)  # symlinks and `..` resolved before the check
        if not any(os.path.commonpath([real, root]) == root for root in self.allowed_roots):
            raise APIError(403, f"{path!r} is outside the model directories this server may read", "permission_error",
                           "path")
        if not os.path.exists(real):
            raise APIError(404, f"{path!r} does not exist", "not_found_error", "path")
        return real

    async def reload(self, name: str, body: bytes) -> dict[str, Any]:
        try:
            request = json.loads(body) if body else {}
        except ValueError as exc:
            raise APIError(400, "the body must be JSON: {\"path\": ...}") from exc
        path = request.get("path") if isinstance(request, dict) else None
        if not isinstance(path, str) or not path:
            raise APIError(400, "give the new version's file or directory as `path`", param="path")
        path = self._allowed(path)
        entry = await self.pool.app_for(name)  # the serving version (loaded if it was not)
        if name in self._swapping:
            raise APIError(409, f"the model `{name}` is being swapped already", "conflict_error")
        self._swapping.add(name)
        try:
            return await self._swap(entry, path)
        finally:
            self._swapping.discard(name)

    async def _swap(self, entry: ModelEntry, path: str) -> dict[str, Any]:
        old = entry.loaded
        assert old is not None
        version = len(entry.versions) + 1
        record: dict[str, Any] = {"version": version, "path": path, "state": "loading", "loaded_at": int(time.time())}
        entry.versions.append(record)
        started = time.monotonic()
        try:
            async with self.pool.lock:
                self.pool.check_memory(entry, path)
                new = await self.pool.launch(entry, path, version)
        except Exception as exc:  # noqa: BLE001 - any load failure rolls back
            record.update(state="failed", reason=f"load failed: {exc}")
            logger.warning("model %s: version %d from %s failed to load (%s): version %d goes on serving",
                           entry.name, version, path, exc, old.version)
            raise APIError(409, f"rolled back: the new version failed to load: {exc}", "conflict_error") from exc
        baseline = await probe_answers(old.llm, self.probes, f"tokenmill-swap-{entry.name}-{version}-old")
        answers = await probe_answers(new.llm, self.probes, f"tokenmill-swap-{entry.name}-{version}-new")
        report = compare(baseline, answers)
        if report.agreement < self.min_agreement:
            await self.pool.close(new)
            reason = (f"probe agreement {report.agreement:.2f} < --swap-min-agreement {self.min_agreement:g} "
                      f"(probes {report.changed} answer differently)")
            record.update(state="failed", reason=reason)
            logger.warning("model %s: version %d from %s rolled back: %s", entry.name, version, path, reason)
            raise APIError(409, f"rolled back: {reason}", "conflict_error")
        entry.loaded, entry.path = new, path
        record.update(state="serving", agreement=report.agreement)
        self.pool.set_state(entry, old.version, "draining")
        asyncio.ensure_future(self._retire(entry, old))
        logger.info("model %s: version %d from %s serves (probe agreement %.2f, %.1f s); version %d drains",
                    entry.name, version, path, report.agreement, time.monotonic() - started, old.version)
        return {"id": entry.name, "version": version, "path": path, "agreement": report.agreement,
                "previous_version": old.version}

    async def _retire(self, entry: ModelEntry, old: LoadedModel) -> None:
        """Close the old version once the requests it holds have finished."""
        while old.in_flight or old.llm.num_open_requests:
            await asyncio.sleep(DRAIN_POLL_S)
        await self.pool.close(old)
        self.pool.set_state(entry, old.version, "retired")
