"""The one server interceptor that maps a raised :class:`MeshError` to its status, for every call shape."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from tokenmesh.errors._taxonomy import InvalidArgument, MeshError

Authorize = Callable[[str, grpc.aio.ServicerContext[Any, Any]], None]
"""Raises PermissionDenied unless the call's peer may call the method (full name, "/pkg.Service/Method")."""


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps :class:`MeshError` raised by any handler to its gRPC status.

    Handlers raise; they never build statuses themselves. Works for all four
    call shapes, also for errors raised mid-stream. A request message that
    does not parse is INVALID_ARGUMENT naming its type (gRPC itself would
    answer UNKNOWN before any handler ran).

    Args:
        authorize: checks the peer before the handler runs (mTLS identities); its PermissionDenied is a status too.

    """

    def __init__(self, authorize: Authorize | None = None) -> None:
        self._authorize = authorize

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        """Wrap the handler's behaviour so MeshError becomes a status (and the peer is authorized first)."""
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        deserializer = _lenient(handler.request_deserializer)
        gate = None
        if self._authorize is not None:
            authorize, method = self._authorize, handler_call_details.method

            def gate(context: grpc.aio.ServicerContext[Any, Any]) -> None:
                authorize(method, context)

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, streamed=False, gate=gate),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, streamed=False, gate=gate),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream(handler.stream_stream, streamed=True, gate=gate),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary, streamed=True, gate=gate),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


class _Undecodable:
    """Stands in for a request message that did not parse; the handler never sees it."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """The deserializer, returning an _Undecodable instead of raising on bytes that do not parse."""
    if deserializer is None:
        return None
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    name = descriptor.full_name if descriptor is not None else "request message"

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return _Undecodable(f"the request is not a valid {name} ({exc}); send a serialized {name}")

    return parse


def _check(request: Any) -> Any:
    if type(request) is _Undecodable:
        raise InvalidArgument(request.message, reason="UNDECODABLE_REQUEST")
    return request


async def _checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _check(request)


async def _abort(context: grpc.aio.ServicerContext[Any, Any], error: MeshError) -> None:
    # The details' ErrorInfo (domain tokenmesh) is also what tells a caller this status was answered by the
    # mesh, where a connection that broke may end with the same code: it resumes only the latter.
    await context.abort(error.grpc_code, error.wire_message, trailing_metadata=error.trailers())


def _unexpected(context: grpc.aio.ServicerContext[Any, Any], error: Exception) -> None:
    """An exception no MeshError: gRPC answers it UNKNOWN (and logs it); the context's code says so too.

    gRPC itself leaves the context's code unset there, and the call's RPC span reads its outcome from the code
    (:class:`tokenmesh._rpc_spans.ServerSpans`). The details name the exception's type only: its message may
    quote a request.
    """
    if context.code() in (None, grpc.StatusCode.OK):
        context.set_code(grpc.StatusCode.UNKNOWN)
        context.set_details(f"unexpected {type(error).__name__}")


Gate = Callable[[grpc.aio.ServicerContext[Any, Any]], None]


def _wrap_unary(
    behaviour: Callable[..., Awaitable[Any]], *, streamed: bool, gate: Gate | None = None
) -> Callable[..., Awaitable[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            if gate is not None:
                gate(context)
            return await behaviour(_checked(request) if streamed else _check(request), context)
        except MeshError as error:
            await _abort(context, error)
        except grpc.aio.AbortError:  # the handler aborted: its code is set
            raise
        except Exception as error:
            _unexpected(context, error)
            raise

    return wrapped


def _wrap_stream(behaviour: Callable[..., Any], *, streamed: bool, gate: Gate | None = None) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(behaviour):
        # Handlers that stream with `await context.write(...)` are coroutines.
        return _wrap_unary(behaviour, streamed=streamed, gate=gate)

    async def wrapped(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        try:
            if gate is not None:
                gate(context)
            async for response in behaviour(_checked(request) if streamed else _check(request), context):
                yield response
        except MeshError as error:
            await _abort(context, error)
        except grpc.aio.AbortError:
            raise
        except Exception as error:
            _unexpected(context, error)
            raise

    return wrapped
