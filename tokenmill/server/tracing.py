"""OpenTelemetry traces (`--otlp-traces-endpoint`, vLLM's flag; the `tracing` extra): one span per request,
`llm_request`, continuing the client's W3C `traceparent` when it sends one, with a child span per phase (queue,
prefill, decode), a `prefill_chunk` span per engine step that computed part of the prompt (under `prefill`), and
the request's numbers as attributes (vLLM's `gen_ai.*` names where they exist; preemptions and migrations).

The engine timestamps each request's events (tokenmill/request.py:RequestTimes, on the monotonic clock the
processes share); the spans are written when the request finishes, with those times, so tracing costs the step
loop nothing."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from tokenmill.outputs import RequestOutput


def _require_sdk() -> None:
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise SystemExit("--otlp-traces-endpoint needs OpenTelemetry: pip install 'tokenmill[tracing]' "
                         "(opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http)") from exc


class RequestTracer:
    def __init__(self, endpoint: str, service_name: str = "tokenmill", export_delay_s: float = 1.0) -> None:
        _require_sdk()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.propagators.textmap import DefaultGetter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=endpoint), schedule_delay_millis=int(export_delay_s * 1000)))
        self.tracer = self.provider.get_tracer("tokenmill")
        self.propagator = TraceContextTextMapPropagator()
        self.getter = DefaultGetter()
        # monotonic engine timestamps -> epoch nanoseconds
        self.epoch_offset = time.time() - time.monotonic()

    def context_from(self, headers: Mapping[str, str]) -> Any:
        """The client's trace context (`traceparent`, `tracestate`), None when it sends none."""
        carrier = {key.lower(): value for key, value in headers.items()}
        return self.propagator.extract(carrier) if "traceparent" in carrier else None

    def _ns(self, monotonic: float) -> int:
        return int((monotonic + self.epoch_offset) * 1e9)

    def on_finished(self, output: RequestOutput, endpoint: str, model: str, context: Any) -> None:
        from opentelemetry import trace

        for completion, times in zip(output.outputs, output.metrics):
            end = times.finished_time or times.last_token_time or time.monotonic()
            attributes: dict[str, Any] = {
                "gen_ai.request.id": output.request_id, "gen_ai.response.model": model,
                "gen_ai.usage.prompt_tokens": len(output.prompt_token_ids),
                "gen_ai.usage.completion_tokens": len(completion.token_ids),
                "gen_ai.response.finish_reasons": [completion.finish_reason or "unknown"],
                "gen_ai.latency.e2e": end - times.arrival_time,
                "tokenmill.endpoint": endpoint, "tokenmill.cached_prompt_tokens": output.num_cached_tokens,
                "tokenmill.num_preemptions": times.num_preemptions,
                "tokenmill.recomputed_tokens": times.num_recomputed_tokens,
                "tokenmill.num_migrations": times.num_migrations,
            }
            if times.first_scheduled_time is not None:
                attributes["gen_ai.latency.time_in_queue"] = times.first_scheduled_time - times.arrival_time
            if times.first_token_time is not None:
                attributes["gen_ai.latency.time_to_first_token"] = times.first_token_time - times.arrival_time
            span = self.tracer.start_span("llm_request", context=context, kind=trace.SpanKind.SERVER,
                                          start_time=self._ns(times.arrival_time), attributes=attributes)
            inside = trace.set_span_in_context(span)
            phases = [("queue", times.arrival_time, times.first_scheduled_time),
                      ("prefill", times.first_scheduled_time, times.first_token_time),
                      ("decode", times.first_token_time, end)]
            for name, start, stop in phases:
                if start is not None and stop is not None:
                    child = self.tracer.start_span(name, context=inside, start_time=self._ns(start))
                    if name == "decode":
                        child.set_attribute("tokenmill.tokens", max(len(completion.token_ids) - 1, 0))
                    if name == "prefill":  # a span per engine step that computed part of the prompt
                        phase = trace.set_span_in_context(child)
                        for chunk_start, chunk_end, tokens in times.prefill_chunks:
                            chunk = self.tracer.start_span("prefill_chunk", context=phase,
                                                           start_time=self._ns(chunk_start),
                                                           attributes={"tokenmill.tokens": tokens})
                            chunk.end(end_time=self._ns(chunk_end))
                    child.end(end_time=self._ns(stop))
            span.end(end_time=self._ns(end))

    def shutdown(self) -> None:
        self.provider.force_flush()
        self.provider.shutdown()
