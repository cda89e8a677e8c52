"""OpenTelemetry traces, configured by the standard ``OTEL_*`` environment variables; off without an endpoint.

One trace per generation: the caller's W3C ``traceparent`` (gRPC metadata, or
the gateway's HTTP header) is the parent of the router's RPC server span, the
generation's span its child; the router's call to the worker (a client RPC
span, the generation span's child) carries the context on to the worker's RPC
server span and its generation span. The RPC spans come from
``opentelemetry-instrumentation-grpc`` (:mod:`tokenmesh._rpc_spans`), on every
server (:func:`server_interceptors`) and channel (:func:`traced_channel`)
of the mesh, and only while tracing is on: off, no interceptor is added at
all (and the instrumentation is not imported). Span names and attributes follow the GenAI semantic conventions
(``{operation} {model}``, ``gen_ai.request.model``, ``gen_ai.usage.*``...),
plus tokenmesh's own (``tokenmesh.worker``, ``tokenmesh.queue_ms``...). No
prompt or output text goes into a span.

Tracing is on when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set and ``OTEL_TRACES_EXPORTER`` is
not ``none``; spans go out over OTLP/gRPC in batches (``OTEL_BSP_*``), from a
provider of the service's own (``OTEL_SERVICE_NAME``, default
``tokenmesh-<service>``). Off, the tracer is OpenTelemetry's no-op one: its
spans record nothing, cost next to nothing, and carry the caller's trace
context on, so code that traces never asks whether tracing is on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

PROPAGATOR = TraceContextTextMapPropagator()
"""W3C trace context: ``traceparent`` and ``tracestate``. A malformed one is ignored (a new trace starts)."""


def enabled_by_environment() -> bool:
    """Whether the OTEL_* variables ask for traces to be exported."""
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


class Tracing:
    """A service's tracer (the no-op one while tracing is off) and its provider, flushed and shut down with it.

    Args:
        service: the service's name (``router``, ``worker``, ``prober``, ``gateway``).
        enabled: force on or off (None: from the environment).

    """

    tracer: trace.Tracer
    """Starts the service's spans; a :class:`~opentelemetry.trace.NoOpTracer` while tracing is off."""
    _provider: Any

    def __init__(self, service: str, enabled: bool | None = None) -> None:
        self.tracer = trace.NoOpTracer()
        self._provider = None
        if not (enabled_by_environment() if enabled is None else enabled):
            return
        # Imported only when on: the SDK and the exporter cost start-up time and memory otherwise.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        name = os.environ.get("OTEL_SERVICE_NAME") or f"tokenmesh-{service}"
        self._provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self.tracer = self._provider.get_tracer("tokenmesh")
        log.info("%s exports traces over OTLP as %s", service, name)

    def shutdown(self) -> None:
        """Export what is pending, then stop (idempotent)."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None
            self.tracer = trace.NoOpTracer()

    def flush(self) -> None:
        """Export every finished span now."""
        if self._provider is not None:
            self._provider.force_flush()

    @property
    def on(self) -> bool:
        """Whether spans are recorded and exported (a provider of the service's own)."""
        return self._provider is not None

    @property
    def provider(self) -> Any:
        """The service's TracerProvider (None while tracing is off): the RPC span interceptors' too."""
        return self._provider


def server_interceptors(tracing: Tracing | None) -> list[grpc.aio.ServerInterceptor]:
    """A server's RPC span interceptor, to put first (outermost); none while tracing is off."""
    if tracing is None or not tracing.on:
        return []
    from tokenmesh._rpc_spans import server_interceptor  # the instrumentation loads only when on

    return [server_interceptor(tracing.provider)]


def traced_channel(tracing: Tracing | None, channel: grpc.aio.Channel, target: str) -> grpc.aio.Channel:
    """The channel, with an RPC span on each call (``server.address`` from target) while tracing is on.

    The one place every channel of the mesh gets them (:func:`tokenmesh.tls.open_channel`): a wrapper that opens
    the span where the call is made and hands back the plain grpc.aio call (``_rpc_spans.TracedChannel``), not a
    grpc.aio client interceptor, which costs every call a task and every message a generator. A
    ``traceparent`` the caller puts in a call's metadata is the client span's parent (the gateway's request span,
    the router's generation span); otherwise the current span is.
    """
    if tracing is None or not tracing.on:
        return channel
    from tokenmesh._rpc_spans import traced_channel as traced  # the instrumentation loads only when on

    return traced(channel, tracing.provider, target)


def client_interceptors(tracing: Tracing | None, target: str) -> list[grpc.aio.ClientInterceptor]:
    """The same client spans as grpc.aio client interceptors, for a channel opened elsewhere; none while off."""
    if tracing is None or not tracing.on:
        return []
    from tokenmesh._rpc_spans import client_interceptors as interceptors

    return interceptors(tracing.provider, target)


def from_metadata(metadata: Iterable[tuple[str, Any]] | None) -> Context:
    """The caller's trace context from gRPC metadata (an empty one when it sent none or a malformed one)."""
    carrier = {k: v for k, v in (metadata or ()) if k in ("traceparent", "tracestate") and isinstance(v, str)}
    return PROPAGATOR.extract(carrier)


def parent(metadata: Iterable[tuple[str, Any]] | None) -> Context | None:
    """The parent of a handler's span: the call's RPC server span, else the caller's ``traceparent`` in metadata.

    None means the current context, where the RPC span is (:func:`server_interceptors`, while this service traces
    and the call's service is not excluded); without one, the caller's context from metadata (a no-op span carries
    it on).
    """
    if trace.get_current_span().get_span_context().is_valid:
        return None
    return from_metadata(metadata)


def rpc_spans_for(service: str) -> bool:
    """Whether calls of service (a full name) get RPC spans: not named in ``OTEL_PYTHON_GRPC_EXCLUDED_SERVICES``.

    Read as the instrumentation reads it (comma-separated, spaces stripped), for spans that stand in for an RPC's.
    """
    return service not in {s.strip() for s in os.environ.get("OTEL_PYTHON_GRPC_EXCLUDED_SERVICES", "").split(",")}


def from_mapping(carrier: Mapping[str, str]) -> Context:
    """A trace context from a mapping of header names (lower-case) to values."""
    return PROPAGATOR.extract(dict(carrier))


def inject(span: trace.Span) -> dict[str, str]:
    """The W3C headers that make span the parent of the receiver's spans."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def operation(chat: bool) -> str:
    """The GenAI operation name of a generation."""
    return "chat" if chat else "text_completion"
