"""`cache_salt` (vLLM's request field): requests with different salts never share KV blocks, in the pool or in
any KV tier, so one tenant cannot learn from a fast first token that another sent the same prompt.

A salt the client picks protects only the clients that send one. `--cache-salt-source` lets the operator make
it the server's: `api-key` salts every request with the key it presented, `header:NAME` with that header's
value (a tenant id a gateway sets); the client's own `cache_salt` is then added to it, never a replacement."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from tokenmill.server.errors import APIError

SOURCES = ("request", "api-key")  # or "header:NAME"


def check_source(source: str) -> str:
    if source in SOURCES or (source.startswith("header:") and len(source) > len("header:")):
        return source
    raise ValueError(f"--cache-salt-source must be request, api-key or header:NAME, got {source!r}")


def request_salt(source: str, http_request: Request, client_salt: str | None) -> str | None:
    """The salt a request's prompts get: the server's part (by `source`) and the client's."""
    if client_salt is not None and not client_salt:
        raise APIError(400, "cache_salt must be a non-empty string", param="cache_salt")
    server = None
    if source == "api-key":
        authorization = http_request.headers.get("authorization", "")
        server = authorization.removeprefix("Bearer ") if authorization else http_request.headers.get("x-api-key")
        server = "key:" + (server or "")
    elif source.startswith("header:"):
        server = "header:" + (http_request.headers.get(source.removeprefix("header:")) or "")
    if server is None:
        return client_salt
    return server if client_salt is None else f"{server}\x00{client_salt}"


def salted(prompt: Any, salt: str | None) -> Any:
    """A prompt (text, token ids or a prompt dict) carrying `salt` to the engine (vLLM's prompt key)."""
    if salt is None:
        return prompt
    if isinstance(prompt, dict):
        return prompt | {"cache_salt": salt}
    if isinstance(prompt, str):
        return {"prompt": prompt, "cache_salt": salt}
    return {"prompt_token_ids": list(prompt), "cache_salt": salt}
