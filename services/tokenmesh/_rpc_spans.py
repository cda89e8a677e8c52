"""RPC spans as ``opentelemetry-instrumentation-grpc`` makes them, opened without a cost per message.

Imported only when tracing is on (see :mod:`tokenmesh.tracing`). Each call
gets the instrumentation's span (its tracer, name, kind, ``rpc.system``,
``rpc.service``, ``rpc.method``, ``rpc.grpc.status_code``) and the W3C
context travels in the metadata, but not through its aio interceptors, which
as released (0.66b2):

- cost every message: the server interceptor re-yields each response through
  a generator of its own, and any grpc.aio client interceptor puts the call
  behind an ``Intercepted*Call`` (a task per call, a generator between the
  reader and every message, a queue and two tasks per ``call.write()``);
- record a server call that the caller cancels (or whose deadline passes)
  with status code 0, OK: the handler sees ``CancelledError``, which the
  interceptor does not catch;
- fail on a server-streaming handler written as a coroutine (``await
  context.write(...)``, as the health ``Watch``): the interceptor iterates it
  with ``async for``;
- end a client span when its response iterator is exhausted, not when the
  call ends: a stream whose reader stops after the last message it needs (the
  router's worker streams) ends its span at garbage collection, and a call
  cancelled meanwhile is recorded as OK; a cancelled unary call never ends
  its span (so it is never exported);
- leave grpc.aio's request-reader task of a bidirectional call written with
  ``call.write()`` waiting after the call ended, once any client interceptor
  is on the channel ("Task was destroyed but it is pending!");
- name no server on client spans (``server.address``/``server.port``) and
  give the peer of server spans in the older ``net.peer.*`` names only.

Server (:class:`ServerSpans`): the span starts in the call's own task before
the handler runs and is current there; gRPC gets the handler's own generator
or coroutine, and the span ends from the context's done callback with the
final code. Client (:class:`TracedChannel`, the mesh's channels): the span
opens where the call is made and the caller gets the plain grpc.aio call; it
ends from the call's done callback. Not a span processor: a processor sees a
span only once it ended, too late to set its outcome.
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
from opentelemetry.instrumentation.grpc._server import _wrap_rpc_behavior
from opentelemetry.instrumentation.grpc._utilities import _server_status
from opentelemetry.instrumentation.grpc.version import __version__
from opentelemetry.instrumentation.utils import is_instrumentation_enabled
from opentelemetry.propagate import extract, inject
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tokenmesh.errors import code_of

_SCHEMA = "https://opentelemetry.io/schemas/1.11.0"  # what the instrumentation's own factories use
_PROPAGATOR = TraceContextTextMapPropagator()
RPC_GRPC_STATUS_CODE = "rpc.grpc.status_code"
DEADLINE_SLACK_S = 0.1
"""A call cancelled this close to its deadline counts as past it. The caller's timer fires first (the server's
deadline is the caller's plus the request's transit) and its cancel may reach the server before the server's
own timer does: CI saw a 0.5 s deadline end as CANCELLED with a few ms left here."""


def _tracer(provider: Any) -> trace.Tracer:
    return trace.get_tracer("opentelemetry.instrumentation.grpc", __version__, provider, schema_url=_SCHEMA)


def server_interceptor(provider: Any) -> grpc.aio.ServerInterceptor:
    """The server interceptor (as ``aio_server_interceptor(provider)`` builds it, corrected).

    As the instrumentation's own instrumentors do, services named in ``OTEL_PYTHON_GRPC_EXCLUDED_SERVICES``
    (comma-separated full names, e.g. ``grpc.health.v1.Health``) get no spans.
    """
    return ServerSpans(_tracer(provider), filter_=_excluded_service_filter())


def traced_channel(channel: grpc.aio.Channel, provider: Any, target: str) -> grpc.aio.Channel:
    """channel, its calls with client RPC spans (:class:`TracedChannel`): how the mesh's own channels get them."""
    spans = ClientSpanOpener(_tracer(provider), _server_attributes(target), _excluded_service_filter())
    return TracedChannel(channel, spans)


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


def _status_code(code: Any) -> grpc.StatusCode:
    """A ServicerContext's code(): None until set, then a grpc.StatusCode (or its number after set_code)."""
    if code is None:
        return grpc.StatusCode.OK
    return code if isinstance(code, grpc.StatusCode) else code_of(int(code))


def _close(span: trace.Span, task: asyncio.Task[Any] | None, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    """End a server span with the call's outcome (the context's done callback: the call's task has finished).

    A call that gRPC cancelled (the caller went away, or the deadline passed) is one whose task was cancelled:
    gRPC catches the CancelledError, and the context's code() stays unset.
    """
    try:
        if task is not None and task.cancelling():
            remaining = context.time_remaining()
            late = remaining is not None and remaining <= DEADLINE_SLACK_S
            code = grpc.StatusCode.DEADLINE_EXCEEDED if late else grpc.StatusCode.CANCELLED
            details = "the call ended before its handler did"
        else:
            code, details = _status_code(context.code()), context.details()
        span.set_attribute(RPC_GRPC_STATUS_CODE, code.value[0])
        if code != grpc.StatusCode.OK:
            # The instrumentation's table (the semantic conventions): on the server CANCELLED leaves the status
            # unset, as do the caller's errors (INVALID_ARGUMENT...); UNKNOWN, INTERNAL, UNAVAILABLE... are ERROR.
            span.set_status(_server_status(code, details))
    finally:
        span.end()


async def _stream_shape(request: Any, context: Any) -> AsyncIterator[Any]:  # pragma: no cover - never called
    yield None


async def _unary_shape(request: Any, context: Any) -> Any:  # pragma: no cover - never called
    return None


class _InCallsTask:
    """A handler that opens its call's span, then gives gRPC the handler's own generator or coroutine.

    No wrapper between gRPC and the handler: a wrapping generator would re-yield every message (a generator hop
    per message, as the instrumentation's own interceptor does). The span is made current in the call's task
    (grpc.aio runs the interceptors, then the handler's generator, in one task per call), so the handler's spans
    are its children; it ends in the context's done callback. gRPC tells an async generator handler from a
    coroutine one by its code's flags (``inspect.isasyncgenfunction``), which this object presents as a
    function-like object does: those of ``shape``, the behavior's kind.
    """

    def __init__(self, behavior: Callable[..., Any], shape: Callable[..., Any], open_: Callable[[Any], None]) -> None:
        self.__code__ = shape.__code__
        self.__name__ = getattr(behavior, "__name__", shape.__name__)
        self.__defaults__ = None
        self.__kwdefaults__ = None
        self.__annotations__: dict[str, Any] = {}
        self._behavior = behavior
        self._open = open_

    def __call__(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        self._open(context)
        return self._behavior(request, context)


def _server_span_attributes(method: str, context: grpc.aio.ServicerContext[Any, Any]) -> dict[str, Any]:
    """The instrumentation's server span attributes (``rpc.*``, ``net.peer.*``) and ``network.peer.*``."""
    service, _, name = method.lstrip("/").partition("/")
    attributes: dict[str, Any] = {
        "rpc.system": "grpc",
        RPC_GRPC_STATUS_CODE: grpc.StatusCode.OK.value[0],
        "rpc.method": name,
        "rpc.service": service,
    }
    peer = context.peer()
    attributes.update(_peer_attributes(peer))
    if not peer.startswith("unix:"):  # the instrumentation's older names, kept for views that use them
        ip, _, port = peer.split(",")[0].partition(":")[2].rpartition(":")
        if ip:
            attributes["net.peer.ip"], attributes["net.peer.port"] = unquote(ip), port
            if unquote(ip) in ("[::1]", "127.0.0.1"):
                attributes["net.peer.name"] = "localhost"
    return attributes


class ServerSpans(grpc.aio.ServerInterceptor):
    """The instrumentation's server span, opened without a wrapper per message; cancels and peers recorded.

    The span (name, kind and attributes as the instrumentation's, plus ``network.peer.*``) starts when gRPC
    calls the handler, in the call's own task, is current there for the handler's whole run, and ends from
    the context's done callback with the final code: what the handler set or aborted with, CANCELLED or
    DEADLINE_EXCEEDED when gRPC cancelled the call. A handler that is neither a coroutine nor an async generator
    (a sync one, run on gRPC's thread pool; the mesh has none) gets no span.

    Args:
        tracer: the instrumentation's tracer on the service's provider.
        filter_: which calls get a span (None: all), as the instrumentation's ``filter_``.

    """

    def __init__(self, tracer: trace.Tracer, filter_: Callable[[Any], bool] | None = None) -> None:
        self._tracer = tracer
        self._filter = filter_

    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        if not is_instrumentation_enabled() or (self._filter is not None and not self._filter(handler_call_details)):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        return _wrap_rpc_behavior(handler, lambda behavior, *_: self._traced(behavior, method))

    def _traced(self, behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):
            shape: Callable[..., Any] = _stream_shape
        elif inspect.iscoroutinefunction(behavior):
            shape = _unary_shape
        else:
            return behavior
        return _InCallsTask(behavior, shape, functools.partial(self._open, method))

    def _open(self, method: str, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Start the call's span, current from now on in the call's task (which ends with the call)."""
        metadata = context.invocation_metadata()
        parent = extract(dict(metadata)) if metadata else None
        attributes = _server_span_attributes(method, context)
        if metadata:
            user_agent = next((value for key, value in metadata if key == "user-agent"), None)
            if user_agent is not None:
                attributes["rpc.user_agent"] = user_agent
        span = self._tracer.start_span(method, parent, kind=trace.SpanKind.SERVER, attributes=attributes)
        # Not detached: the context is the call's task's own, and goes with it.
        otel_context.attach(trace.set_span_in_context(span, parent))
        # grpc-stubs declares the callback a class of its own, not a protocol: any callable is what gRPC takes.
        context.add_done_callback(functools.partial(_close, span, asyncio.current_task()))  # type: ignore[arg-type]


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


class ClientSpanOpener:
    """Opens and ends client RPC spans: the one place that does it, for the traced channel and the interceptors.

    Args:
        tracer: the instrumentation's tracer on the service's provider.
        peer: ``server.address``/``server.port`` of the channel's target.
        filter_: which calls get a span (None: all), as the instrumentation's ``filter_``.

    """

    tracer: trace.Tracer
    filter_: Callable[[Any], bool] | None
    _peer: dict[str, Any]
    _ending: set[asyncio.Task[None]]
    """Spans being ended (the status is read with a coroutine): held so that none is collected midway."""

    def __init__(self, tracer: trace.Tracer, peer: dict[str, Any], filter_: Callable[[Any], bool] | None) -> None:
        self.tracer = tracer
        self.filter_ = filter_
        self._peer = peer
        self._ending = set()

    def traces(self, method: str) -> bool:
        """Whether calls of method get a span (the instrumentation is on and the filter lets it through)."""
        return is_instrumentation_enabled() and (self.filter_ is None or self.filter_(_Method(method)))

    def open(self, method: str, metadata: Any) -> tuple[trace.Span, tuple[tuple[str, Any], ...]]:
        """The call's span and the metadata to call with.

        The span: name, kind and ``rpc.*`` as the instrumentation's, and ``server.*``. The metadata: the caller's,
        with this span's ``traceparent`` in place of any the caller put there.
        """
        parent = _explicit_parent(metadata)
        service, _, name = method.lstrip("/").partition("/")
        attributes = {
            "rpc.system": "grpc",
            RPC_GRPC_STATUS_CODE: grpc.StatusCode.OK.value[0],
            "rpc.method": name,
            "rpc.service": service,
            **self._peer,
        }
        span = self.tracer.start_span(method, parent, kind=trace.SpanKind.CLIENT, attributes=attributes)
        carrier: dict[str, str] = {}
        inject(carrier, context=trace.set_span_in_context(span, parent))  # the server's parent: this span
        kept = tuple((k, v) for k, v in (metadata or ()) if k not in carrier)
        return span, kept + tuple(carrier.items())

    def end_when_done(self, span: trace.Span, call: grpc.aio.Call) -> None:
        """End span with call's final status once it is done."""
        call.add_done_callback(functools.partial(self._done, span))

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

    @staticmethod
    def failed(span: trace.Span, exc: BaseException) -> None:
        """End the span of a call that never started (an interceptor or the channel refused it)."""
        _BaseAioClientInterceptor.add_error_details_to_span(span, exc)
        span.end()


class _Method:
    """What the instrumentation's filters read of a call's details: its method."""

    __slots__ = ("method",)

    def __init__(self, method: str) -> None:
        self.method = method


class _TracedMultiCallable:
    """A channel's callable for one method: each call opens its span, then is the plain grpc.aio call."""

    def __init__(self, inner: Any, method: str, spans: ClientSpanOpener) -> None:
        self._inner = inner
        self._method = method
        self._spans = spans

    def __call__(
        self,
        request: Any = None,
        timeout: float | None = None,
        metadata: Any = None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> Any:
        span, metadata = self._spans.open(self._method, metadata)
        try:
            call = self._inner(
                request,
                timeout=timeout,
                metadata=metadata,
                credentials=credentials,
                wait_for_ready=wait_for_ready,
                compression=compression,
            )
        except BaseException as exc:
            self._spans.failed(span, exc)
            raise
        self._spans.end_when_done(span, call)
        return call


class TracedChannel(grpc.aio.Channel):
    """A grpc.aio channel whose calls get client RPC spans, without a grpc.aio client interceptor.

    Any client interceptor makes grpc.aio run each call behind an ``Intercepted*Call``: a task to start it, a
    generator between the reader and every message, and for ``call.write()`` a queue, two tasks per write and a
    task that feeds the real call. Here the span opens where the stub's callable is called (the caller's context
    is current there, as in an interceptor), the ``traceparent`` goes in the call's metadata, and the caller gets
    the plain call; the span ends from its done callback.
    """

    def __init__(self, channel: grpc.aio.Channel, spans: ClientSpanOpener) -> None:
        self._channel = channel
        self._spans = spans

    def _traced(self, inner: Any, method: str) -> Any:
        return _TracedMultiCallable(inner, method, self._spans) if self._spans.traces(method) else inner

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._traced(self._channel.unary_unary(method, *args, **kwargs), method)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._traced(self._channel.unary_stream(method, *args, **kwargs), method)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._traced(self._channel.stream_unary(method, *args, **kwargs), method)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._traced(self._channel.stream_stream(method, *args, **kwargs), method)

    async def __aenter__(self) -> TracedChannel:
        await self._channel.__aenter__()
        return self

    async def __aexit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        await self._channel.__aexit__(exc_type, exc_val, exc_tb)

    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self._channel.channel_ready()


class _ClientSpans(_BaseAioClientInterceptor):
    """One client call's span, as :class:`TracedChannel` opens it, for a channel the mesh does not open itself.

    Args:
        tracer: the instrumentation's tracer on the service's provider.
        peer: ``server.address``/``server.port`` of the channel's target.
        filter_: which calls get a span (None: all), as the instrumentation's ``filter_``.

    """

    _spans: ClientSpanOpener

    def __init__(self, tracer: trace.Tracer, peer: dict[str, Any], filter_: Callable[[Any], bool] | None) -> None:
        super().__init__(tracer, filter_=filter_)
        self._spans = ClientSpanOpener(tracer, peer, filter_)

    async def _call(
        self, continuation: Callable[..., Awaitable[Any]], details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        if self.tracing_skipped(details):  # no span; the request reader still needs ending
            call = await continuation(details, request)
            call.add_done_callback(_stop_request_reader)
            return call
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        span, metadata = self._spans.open(method, details.metadata)
        details = grpc.aio.ClientCallDetails(
            details.method, details.timeout, grpc.aio.Metadata(*metadata), details.credentials, details.wait_for_ready
        )
        try:
            call = await continuation(details, request)
        except BaseException as exc:  # never started (an interceptor or the channel refused it)
            self._spans.failed(span, exc)
            raise
        self._spans.end_when_done(span, call)
        return call


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
