"""The gate every HTTP request passes: a request id, a body-size limit, and no new work while draining.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which would buffer streaming responses).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_REQUEST_ID_CHARS = 256
_BODY_METHODS = {"POST", "PUT", "PATCH"}


@dataclass
class ServerState:
    """What the gate and the shutdown logic share."""

    draining: bool = False
    in_flight: int = 0  # HTTP requests inside the app, streams included
    exit_code: int = 0


def error_body(status: int, message: str, err_type: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object, as every error response and SSE error event carries it."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


async def send_error(send: Send, status: int, message: str, err_type: str, headers: dict[str, str]) -> None:
    body = json.dumps(error_body(status, message, err_type)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


class RequestGate:
    """- `X-Request-Id`: honoured (or one is made) and echoed on every response; the app finds it in
      `request.state.request_id` and uses it in response ids and log lines (as vLLM does).
    - Bodies over `max_body_bytes` get 413 before the app sees them.
    - While the server drains, new API requests get 503 with Retry-After (health and metrics still answer).
    """

    def __init__(self, app: ASGIApp, state: ServerState, max_body_bytes: int) -> None:
        self.app = app
        self.state = state
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-request-id", b"").decode("latin-1").strip()
        request_id = given[:MAX_REQUEST_ID_CHARS] or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        id_header = (b"x-request-id", request_id.encode("latin-1"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), id_header]
            await send(message)

        if self.state.draining and scope["path"].startswith("/v1/"):
            await send_error(send_with_id, 503, "the server is shutting down", "service_unavailable",
                             {"Retry-After": "5"})
            return
        too_large = f"the request body exceeds the limit of {self.max_body_bytes} bytes"
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await send_error(send_with_id, 413, too_large, "invalid_request_error", {"Connection": "close"})
            return

        app_receive = receive
        if scope["method"] in _BODY_METHODS:
            # Read the body here, bounded, and replay it; later receive() calls pass through (disconnects).
            chunks: list[bytes] = []
            size = 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_body_bytes:
                    await send_error(send_with_id, 413, too_large, "invalid_request_error", {"Connection": "close"})
                    return
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            pending: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

            async def replay() -> Message:
                return pending.pop() if pending else await receive()

            app_receive = replay

        self.state.in_flight += 1
        try:
            await self.app(scope, app_receive, send_with_id)
        finally:
            self.state.in_flight -= 1
