"""RPC spans from ``opentelemetry-instrumentation-grpc``, with its aio interceptors' gaps closed.

Imported only when tracing is on (see :mod:`tokenmesh.tracing`). The
instrumentation's aio interceptors give each call the standard span
(``rpc.system``, ``rpc.service``, ``rpc.method``, ``rpc.grpc.status_code``)
and carry the W3C context in the metadata; subclassed here because, as
released (0.66b2):

- a server call that the caller cancels (or whose deadline passes) is
  recorded with status code 0, OK: the handler sees ``CancelledError``, which
  the interceptor does not catch;
- a server-streaming handler written as a coroutine (``await
  context.write(...)``, as the health ``Watch``) fails: the interceptor
  iterates it with ``async for``;
- a client span ends when its response iterator is exhausted, not when the
  call ends: a stream whose reader stops after the last message it needs (the
  router's worker streams) ends its span at garbage collection, and a call
  cancelled meanwhile is recorded as OK; a cancelled unary call never ends
  its span (so it is never exported);
- a bidirectional call written with ``call.write()`` leaves grpc.aio's
  request-reader task waiting after the call ended, once any client
  interceptor is on the channel ("Task was destroyed but it is pending!");
- client spans name no server (``server.address``/``server.port``) and server
  spans give the peer in the older ``net.peer.*`` names only.

Subclasses, not a span processor: a processor sees a span only once it ended,
too late to set its outcome. The client span here ends on the call's done
callback, when gRPC knows the final status; the call itself is returned
unwrapped, so reading a stream costs nothing more when traced.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import _excluded_service_filter
from opentelemetry.instrumentation.grpc._aio_client import (
    StreamStreamAioClientInterceptor,
    StreamUnaryAioClientInterceptor,
    UnaryStreamAioClientInterceptor,
    UnaryUnaryAioClientInterceptor,
    _BaseAioClientInterceptor,
)
from opentelemetry.instrumentation.grpc._aio_server import OpenTelemetryAioServerInterceptor
from opentelemetry.instrumentation.grpc._utilities import _server_status
from opentelemetry.instrumentation.grpc.version import __version__
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_SCHEMA = "https://opentelemetry.io/schemas/1.11.0"  # what the instrumentation's own factories use
_PROPAGATOR = TraceContextTextMapPropagator()
RPC_GRPC_STATUS_CODE = "rpc.grpc.status_code"


def _tracer(provider: Any) -> trace.Tracer:
    return trace.get_tracer("opentelemetry.instrumentation.grpc", __version__, provider, schema_url=_SCHEMA)


def server_interceptor(provider: Any) -> grpc.aio.ServerInterceptor:
    """The server interceptor (as ``aio_server_interceptor(provider)`` builds it, corrected).

    As the instrumentation's own instrumentors do, services named in ``OTEL_PYTHON_GRPC_EXCLUDED_SERVICES``
    (comma-separated full names, e.g. ``grpc.health.v1.Health``) get no spans.
    """
    return ServerSpans(_tracer(provider), filter_=_excluded_service_filter())


def client_interceptors(provider: Any, target: str) -> list[grpc.aio.ClientInterceptor]:
    """A channel's client interceptors, one per call shape (as ``aio_client_interceptors(provider)``, corrected)."""
    tracer = _tracer(provider)
    peer = _server_attributes(target)
    excluded = _excluded_service_filter()
    return [
        UnaryUnaryClientSpans(tracer, peer, excluded),
        UnaryStreamClientSpans(tracer, peer, excluded),
        StreamUnaryClientSpans(tracer, peer, excluded),
        StreamStreamClientSpans(tracer, peer, excluded),
    ]


# -- server ------------------------------------------------------------------


def _peer_attributes(peer: str) -> dict[str, Any]:
    """``network.peer.address``/``port`` from a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``, ``unix:p``)."""
    scheme, _, rest = peer.partition(":")
    if scheme == "unix":
        return {"network.peer.address": rest, "network.transport": "unix"}
    host, _, port = unquote(rest).rpartition(":")
    if not host:
        return {}
    return {"network.peer.address": host.strip("[]"), "network.peer.port": int(port) if port.isdigit() else port}


def _ended_early(span: trace.Span, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    """The outcome of a call that gRPC cancelled: its deadline passed, or the caller went away."""
    remaining = context.time_remaining()
    code = grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 else grpc.StatusCode.CANCELLED
    span.set_attribute(RPC_GRPC_STATUS_CODE, code.value[0])
    # The instrumentation's table (the semantic conventions): on the server CANCELLED leaves the status unset.
    span.set_status(_server_status(code, "the call ended before its handler did"))


def _observed_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def observed(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        span = trace.get_current_span()  # the RPC span: the instrumentation runs us inside it
        span.set_attributes(_peer_attributes(context.peer()))
        try:
            return await behavior(request, context)
        except asyncio.CancelledError:
            _ended_early(span, context)
            raise

    return observed


def _observed_stream(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def observed(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        span = trace.get_current_span()
        span.set_attributes(_peer_attributes(context.peer()))
        try:
            async for response in behavior(request, context):
                yield response
        except (asyncio.CancelledError, GeneratorExit):
            _ended_early(span, context)
            raise

    return observed


class ServerSpans(OpenTelemetryAioServerInterceptor):
    """The instrumentation's aio server interceptor, recording a cancelled call as such and the peer's address."""

    def _intercept_aio_server_unary(self, behavior: Any, handler_call_details: Any) -> Any:
        return super()._intercept_aio_server_unary(_observed_unary(behavior), handler_call_details)

    def _intercept_aio_server_stream(self, behavior: Any, handler_call_details: Any) -> Any:
        if not inspect.isasyncgenfunction(behavior):  # streams with `await context.write(...)`: a coroutine
            return self._intercept_aio_server_unary(behavior, handler_call_details)
        return super()._intercept_aio_server_stream(_observed_stream(behavior), handler_call_details)


# -- client ------------------------------------------------------------------


def _server_attributes(target: str) -> dict[str, Any]:
    """``server.address``/``server.port`` of a channel target (``host:port``, ``[v6]:port``, ``dns:///host:port``)."""
    address = target.split("///", 1)[-1] if target.startswith("dns:") else target
    if address.startswith("unix:"):
        return {"server.address": address.removeprefix("unix:")}
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return {"server.address": address}
    return {"server.address": host.strip("[]"), "server.port": int(port)}


def _explicit_parent(metadata: Any) -> otel_context.Context | None:
    """The context a caller put in the call's metadata itself (a ``traceparent``), which wins over the current one.

    The gateway passes its request span this way, and the router its generation's span on a worker call: neither
    is the current span where the call is made.
    """
    carrier = {k: v for k, v in (metadata or ()) if k in ("traceparent", "tracestate") and isinstance(v, str)}
    return _PROPAGATOR.extract(carrier) if "traceparent" in carrier else None


def _stop_request_reader(call: grpc.aio.Call) -> None:
    """End an ended call's request reader task.

    An intercepted call written with ``call.write()`` feeds the real call through an iterator, whose reader task
    grpc.aio cancels on a local cancel only: after the server ended the call it would wait for the next write
    until it is collected ("Task was destroyed but it is pending!").
    """
    poller = getattr(call, "_async_request_poller", None)
    if poller is not None and not poller.done():
        poller.cancel()


class _ClientSpans(_BaseAioClientInterceptor):
    """One client call's span, ended with the call's final status (see the module's docstring).

    Args:
        tracer: the instrumentation's tracer on the service's provider.
        peer: ``server.address``/``server.port`` of the channel's target.
        filter_: which calls get a span (None: all), as the instrumentation's ``filter_``.

    """

    _peer: dict[str, Any]
    _ending: set[asyncio.Task[None]]
    """Spans being ended (the status is read with a coroutine): held so that none is collected midway."""

    def __init__(self, tracer: trace.Tracer, peer: dict[str, Any], filter_: Callable[[Any], bool] | None) -> None:
        super().__init__(tracer, filter_=filter_)
        self._peer = peer
        self._ending = set()

    async def _call(
        self, continuation: Callable[..., Awaitable[Any]], details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        if self.tracing_skipped(details):  # no span; the request reader still needs ending
            call = await continuation(details, request)
            call.add_done_callback(_stop_request_reader)
            return call
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        parent = _explicit_parent(details.metadata)
        token = otel_context.attach(parent) if parent is not None else None
        try:
            with self._start_span(
                method, end_on_exit=False, record_exception=False, set_status_on_exception=False
            ) as span:
                span.set_attributes(self._peer)
                details = self.propagate_trace_in_details(details)  # this span becomes the server's parent
        finally:
            if token is not None:
                otel_context.detach(token)
        try:
            call = await continuation(details, request)
        except BaseException as exc:  # never started (an interceptor or the channel refused it)
            self.add_error_details_to_span(span, exc)
            span.end()
            raise
        call.add_done_callback(functools.partial(self._done, span))
        return call

    def _done(self, span: trace.Span, call: grpc.aio.Call) -> None:
        _stop_request_reader(call)
        ending = asyncio.ensure_future(self._end(span, call))
        self._ending.add(ending)
        ending.add_done_callback(self._ending.discard)

    @staticmethod
    async def _end(span: trace.Span, call: grpc.aio.Call) -> None:
        try:
            code = await call.code()  # the call is done: answered at once
            span.set_attribute(RPC_GRPC_STATUS_CODE, code.value[0])
            if code != grpc.StatusCode.OK:
                span.set_status(Status(StatusCode.ERROR, f"{code.name}: {await call.details()}"))
        finally:
            span.end()


class UnaryUnaryClientSpans(_ClientSpans, UnaryUnaryAioClientInterceptor):
    """Spans of unary calls."""

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await self._call(continuation, client_call_details, request)


class UnaryStreamClientSpans(_ClientSpans, UnaryStreamAioClientInterceptor):
    """Spans of server-streaming calls."""

    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await self._call(continuation, client_call_details, request)


class StreamUnaryClientSpans(_ClientSpans, StreamUnaryAioClientInterceptor):
    """Spans of client-streaming calls."""

    async def intercept_stream_unary(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return await self._call(continuation, client_call_details, request_iterator)


class StreamStreamClientSpans(_ClientSpans, StreamStreamAioClientInterceptor):
    """Spans of bidirectional calls."""

    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return await self._call(continuation, client_call_details, request_iterator)
