"""OpenTelemetry traces (--otlp-traces-endpoint): an OTLP/HTTP receiver in the test gets, for each request, an
`llm_request` span continuing the client's W3C traceparent, with queue, prefill and decode spans under it in
time order, and the request's numbers as attributes."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import httpx

from tokenmill.bench.server_process import free_port, live_server


class _Receiver(BaseHTTPRequestHandler):
    spans: list[Any] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        body = self.rfile.read(int(self.headers["Content-Length"]))
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        for resource in export.resource_spans:
            for scope in resource.scope_spans:
                _Receiver.spans.extend(scope.spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def _attributes(span: Any) -> dict[str, Any]:
    out = {}
    for item in span.attributes:
        value = item.value
        out[item.key] = getattr(value, value.WhichOneof("value"))
    return out


def test_a_span_per_request_continues_the_client_trace() -> None:
    port = free_port()
    receiver = HTTPServer(("127.0.0.1", port), _Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    try:
        with live_server("--otlp-traces-endpoint", f"http://127.0.0.1:{port}/v1/traces",
                         "--max-num-batched-tokens", "64") as server:
            reply = httpx.post(server.url + "/v1/completions", timeout=60,
                               headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
                               json={"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 6})
            assert reply.status_code == 200
            httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": "SmolLM2-135M-Instruct", "prompt": "Bye", "max_tokens": 3})
            long = httpx.post(server.url + "/v1/completions", timeout=60,  # a prompt in several 64-token chunks
                              json={"model": "SmolLM2-135M-Instruct", "prompt": "one two three " * 50,
                                    "max_tokens": 2})
            long_prompt = long.json()["usage"]["prompt_tokens"]
            chunks = -(-long_prompt // 64)
            deadline = time.monotonic() + 30
            while len(_Receiver.spans) < 14 + chunks and time.monotonic() < deadline:
                time.sleep(0.2)
    finally:
        receiver.shutdown()
    roots = [s for s in _Receiver.spans if s.name == "llm_request"]
    assert len(roots) == 3
    continued = next(s for s in roots if s.trace_id.hex() == trace_id)
    assert continued.parent_span_id.hex() == parent_id  # the client's span is its parent
    other = next(s for s in roots if s is not continued and _attributes(s)["gen_ai.usage.prompt_tokens"] < 64)
    assert not other.parent_span_id and other.trace_id.hex() != trace_id  # no traceparent: a trace of its own
    attributes = _attributes(continued)
    assert attributes["gen_ai.usage.completion_tokens"] == 6 and attributes["gen_ai.usage.prompt_tokens"] >= 1
    assert attributes["tokenmill.endpoint"] == "/v1/completions"
    assert attributes["gen_ai.latency.time_to_first_token"] > 0
    children = sorted((s for s in _Receiver.spans if s.parent_span_id == continued.span_id),
                      key=lambda s: s.start_time_unix_nano)
    assert [s.name for s in children] == ["queue", "prefill", "decode"]
    assert all(s.trace_id == continued.trace_id for s in children)
    assert continued.start_time_unix_nano <= children[0].start_time_unix_nano
    assert all(a.end_time_unix_nano <= b.start_time_unix_nano + 1000 for a, b in zip(children, children[1:]))
    assert children[-1].end_time_unix_nano <= continued.end_time_unix_nano

    # the long prompt: a prefill_chunk span per engine step, under its prefill span, 64 tokens each but the last
    root = next(s for s in roots if _attributes(s)["gen_ai.usage.prompt_tokens"] == long_prompt)
    assert _attributes(root)["tokenmill.num_migrations"] == 0
    prefill = next(s for s in _Receiver.spans if s.parent_span_id == root.span_id and s.name == "prefill")
    pieces = sorted((s for s in _Receiver.spans if s.parent_span_id == prefill.span_id),
                    key=lambda s: s.start_time_unix_nano)
    assert [s.name for s in pieces] == ["prefill_chunk"] * chunks
    assert [_attributes(s)["tokenmill.tokens"] for s in pieces] == [64] * (chunks - 1) + [long_prompt - 64 * (
        chunks - 1)]
    assert all(a.end_time_unix_nano <= b.start_time_unix_nano + 1000 for a, b in zip(pieces, pieces[1:]))
    assert prefill.start_time_unix_nano <= pieces[0].start_time_unix_nano + 1000
