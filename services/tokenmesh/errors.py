"""One error taxonomy for the whole mesh.

Every error a service raises on purpose is a :class:`MeshError`. Each class
knows its gRPC status code (and the HTTP status the gateway will use), and
:class:`ErrorInterceptor` turns it into that status with its message. Errors a
worker reports about a generation travel as a typed ``GenerationError``; the
class is decided once, from the error itself, by :func:`classify_backend_message`.
"""

from __future__ import annotations

import enum
import inspect
import logging
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import grpc
from google.protobuf import duration_pb2
from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from tokenmesh.v1 import worker_pb2

log = logging.getLogger(__name__)

DOMAIN = "tokenmesh"
"""``ErrorInfo.domain`` of every error a tokenmesh service answers itself."""

RETRY_AFTER = "retry-after-ms"
"""The retry hint as a plain trailer, still sent beside ``RetryInfo`` for callers that predate the details
(grpcurl scripts, clients of older releases); nothing of ours reads it."""


def label(value: int | enum.Enum, enum_type: EnumTypeWrapper | None = None, prefix: str = "") -> str:
    """The lower-case label of an enum value: ``label(FINISH_REASON_STOP, FinishReason)`` is ``"stop"``.

    Protobuf enums (give their type) lose the type's prefix, which is the
    enum's name in UPPER_SNAKE unless ``prefix`` says otherwise; Python enums
    (``grpc.StatusCode.NOT_FOUND``) are their name.
    """
    if isinstance(value, enum.Enum):
        return value.name.lower()
    assert enum_type is not None, "a protobuf enum value needs its enum type"
    name = enum_type.Name(value)
    head = prefix or re.sub(r"(?<!^)(?=[A-Z])", "_", enum_type.DESCRIPTOR.name).upper() + "_"
    return name.removeprefix(head).lower()


MAX_DESCRIPTION = 256
"""Longest field-violation description taken from an error's message."""

MAX_MESSAGE = 2048
"""Longest message a status carries. It travels twice (grpc-message, and Status.message in the details, base64):
a longer one (a backend's error text) is cut, so the trailers stay under gRPC's metadata limit (8 KiB by default),
past which the caller would get RESOURCE_EXHAUSTED "received metadata size exceeds" instead of the error."""


@dataclass(frozen=True)
class FieldViolation:
    """A request field at fault (``google.rpc.BadRequest.FieldViolation``)."""

    field: str
    """The field's path in the request, e.g. ``max_tokens`` or ``messages[0].role``."""
    description: str


class MeshError(Exception):
    """Base of every error the mesh reports to a caller, with the facts its status details carry.

    Args:
        message: what went wrong and what to change (the status message, unchanged on the wire).
        reason: the kind of error in UPPER_SNAKE (``ErrorInfo.reason``); default: the status code's name.
        metadata: facts for programs (``ErrorInfo.metadata``: model, worker...).
        field: the request field at fault, as a ``BadRequest`` field violation described by the message.
        field_violations: several, or with descriptions of their own.
        retry_delay: seconds to wait before the same call may succeed (``RetryInfo``).
        domain: ``ErrorInfo.domain``; "" for a status that came without one (not answered by the mesh).

    """

    grpc_code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    http_status: ClassVar[int] = 500

    message: str
    reason: str
    domain: str
    metadata: dict[str, str]
    field_violations: tuple[FieldViolation, ...]
    retry_delay: float | None

    def __init__(  # wide: keyword-only details of the google.rpc status, each optional
        self,
        message: str,
        *,
        reason: str = "",
        metadata: Mapping[str, str] | None = None,
        field: str = "",
        field_violations: Sequence[FieldViolation] = (),
        retry_delay: float | None = None,
        domain: str = DOMAIN,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason or self.grpc_code.name
        self.domain = domain
        self.metadata = {k: str(v) for k, v in (metadata or {}).items()}
        # The description repeats the message, which travels twice already (grpc-message and Status.message):
        # bounded, so a long message cannot push the trailers past gRPC's metadata limit (8 KiB by default).
        described = message if len(message) <= MAX_DESCRIPTION else message[: MAX_DESCRIPTION - 1] + "…"
        self.field_violations = (*((FieldViolation(field, described),) if field else ()), *field_violations)
        self.retry_delay = retry_delay

    @property
    def wire_message(self) -> str:
        """The message as the status carries it (cut at MAX_MESSAGE)."""
        message = self.message
        return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 1] + "…"

    @property
    def answered(self) -> bool:
        """Whether a tokenmesh service answered this status itself (not a connection that broke)."""
        return self.domain == DOMAIN

    def status(self) -> status_pb2.Status:
        """The error as a ``google.rpc.Status`` with its details (ErrorInfo, then BadRequest, RetryInfo)."""
        details = [
            error_details_pb2.ErrorInfo(reason=self.reason, domain=self.domain or DOMAIN, metadata=self.metadata)
        ]
        if self.field_violations:
            details.append(
                error_details_pb2.BadRequest(
                    field_violations=[
                        error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                        for v in self.field_violations
                    ]
                )
            )
        if self.retry_delay is not None:
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(round(max(0.0, self.retry_delay) * 1e9))
            details.append(error_details_pb2.RetryInfo(retry_delay=delay))
        status = status_pb2.Status(code=self.grpc_code.value[0], message=self.wire_message)
        for detail in details:
            status.details.add().Pack(detail)
        return status

    def trailers(self) -> tuple[tuple[str, str | bytes], ...]:
        """The trailing metadata of the status: its details, and the legacy retry hint."""
        grpc_status = rpc_status.to_status(self.status())
        legacy = () if self.retry_delay is None else ((RETRY_AFTER, str(math.ceil(self.retry_delay * 1000))),)
        return (*grpc_status.trailing_metadata, *legacy)


class InvalidArgument(MeshError):
    """The request is malformed or out of range; the caller must change it."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400


class NotFound(MeshError):
    """A named thing (model, request_id) does not exist."""

    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class AlreadyExists(MeshError):
    """A caller-chosen request_id is live already."""

    grpc_code = grpc.StatusCode.ALREADY_EXISTS
    http_status = 409


class OutOfRange(MeshError):
    """A position (e.g. Resume's after_seq) is outside what exists."""

    grpc_code = grpc.StatusCode.OUT_OF_RANGE
    http_status = 416


class ResourceExhausted(MeshError):
    """Admission queue full or timed out; retry later (hint in ``retry_delay``)."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429


class Unavailable(MeshError):
    """No live worker can take the request now."""

    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class DeadlineExceeded(MeshError):
    """The caller's deadline passed."""

    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504


class Internal(MeshError):
    """A failure inside the mesh or its backend."""


class Cancelled(MeshError):
    """The call was cancelled (by the caller, or by a server that stopped it)."""

    grpc_code = grpc.StatusCode.CANCELLED
    http_status = 499


class PermissionDenied(MeshError):
    """The caller's identity may not make this call."""

    grpc_code = grpc.StatusCode.PERMISSION_DENIED
    http_status = 403


class Unauthenticated(MeshError):
    """The caller presented no (valid) identity."""

    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401


class Unimplemented(MeshError):
    """The server does not offer this method: the address is some other service, or an older version."""

    grpc_code = grpc.StatusCode.UNIMPLEMENTED
    http_status = 501


ERRORS: tuple[type[MeshError], ...] = (
    InvalidArgument,
    NotFound,
    AlreadyExists,
    OutOfRange,
    ResourceExhausted,
    Unavailable,
    DeadlineExceeded,
    Internal,
    Cancelled,
    PermissionDenied,
    Unauthenticated,
    Unimplemented,
)
"""Every error class; each gRPC code belongs to at most one."""

_BY_CODE: dict[grpc.StatusCode, type[MeshError]] = {cls.grpc_code: cls for cls in ERRORS}


class _Call(Protocol):
    def code(self) -> grpc.StatusCode: ...
    def details(self) -> str | None: ...
    def trailing_metadata(self) -> Any: ...


def from_rpc_error(error: grpc.aio.AioRpcError | _Call) -> MeshError:
    """The mesh's error for a gRPC status a peer sent: the inverse of the table above, with its details.

    The message is the peer's; ``reason``, ``domain`` and ``metadata`` come
    from ``ErrorInfo``, ``field_violations`` from ``BadRequest``,
    ``retry_delay`` from ``RetryInfo`` (decoded as google-api-core does; a
    status without details has ``domain`` ""). Codes with no class of their
    own (UNKNOWN, ABORTED, DATA_LOSS...) become :class:`Internal` with the
    code's name in the message. Raise it ``from`` the gRPC error so the
    original stays in the traceback.
    """
    code = error.code()
    cls = _BY_CODE.get(code)
    message = error.details() or code.name
    facts = _details(error)
    if cls is None:
        return Internal(f"{code.name}: {message}", **facts)
    return cls(message, **facts)


_CODES: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def code_of(number: int) -> grpc.StatusCode:
    """The gRPC code with this number (UNKNOWN for a number gRPC does not define)."""
    return _CODES.get(number, grpc.StatusCode.UNKNOWN)


def status_code(status: status_pb2.Status) -> grpc.StatusCode:
    """The gRPC code of a ``google.rpc.Status`` (UNKNOWN for a number gRPC does not define)."""
    return code_of(status.code)


def rpc_error(status: status_pb2.Status) -> grpc.aio.AioRpcError:
    """The error a call that ended with status raises: its code, message and details in the trailers.

    A logical stream that ends with a status (a ``Worker/Link`` stream's
    ``LinkEnd.status``) raises this, so its reader classifies it with the same
    code as a call's: :func:`from_rpc_error`, the retry and failover rules.
    """
    trailers = grpc.aio.Metadata((rpc_status.GRPC_DETAILS_METADATA_KEY, status.SerializeToString()))
    return grpc.aio.AioRpcError(status_code(status), grpc.aio.Metadata(), trailers, details=status.message)


def from_status(status: status_pb2.Status) -> MeshError:
    """The mesh's error for a ``google.rpc.Status``: :meth:`MeshError.status` inverted, as from_rpc_error."""
    return from_rpc_error(rpc_error(status))


def _details(error: grpc.aio.AioRpcError | _Call) -> dict[str, Any]:
    """The keyword arguments of a MeshError from a status's ``google.rpc.Status`` details."""
    facts: dict[str, Any] = {"domain": ""}
    try:
        status = rpc_status.from_call(error)
    except (ValueError, DecodeError) as exc:  # details that contradict the status, or do not parse
        log.debug("status details of %s ignored: %s", error.code().name, exc)
        return facts
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            facts.update(reason=info.reason, domain=info.domain, metadata=dict(info.metadata))
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            facts["field_violations"] = tuple(FieldViolation(v.field, v.description) for v in bad.field_violations)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            facts["retry_delay"] = retry.retry_delay.ToNanoseconds() / 1e9
    return facts


ERROR_CLASS_TO_EXCEPTION: dict[worker_pb2.ErrorClass, type[MeshError]] = {
    worker_pb2.ERROR_CLASS_INVALID_REQUEST: InvalidArgument,
    worker_pb2.ERROR_CLASS_MODEL_NOT_FOUND: NotFound,
    worker_pb2.ERROR_CLASS_UNAVAILABLE: Unavailable,
    worker_pb2.ERROR_CLASS_TIMEOUT: DeadlineExceeded,
    worker_pb2.ERROR_CLASS_OUT_OF_MEMORY: Unavailable,
    worker_pb2.ERROR_CLASS_BACKEND: Internal,
    worker_pb2.ERROR_CLASS_DEVICE_LOST: Unavailable,
}

# Error classes that say nothing bad about the worker: the caller must act.
CALLER_ERROR_CLASSES = frozenset({worker_pb2.ERROR_CLASS_INVALID_REQUEST, worker_pb2.ERROR_CLASS_MODEL_NOT_FOUND})

# (pattern, class) in priority order, matched against backend error text. The
# texts are what Triton, its Python backend, vLLM and llama.cpp actually send.
_BACKEND_PATTERNS: tuple[tuple[re.Pattern[str], worker_pb2.ErrorClass], ...] = tuple(
    (re.compile(p, re.IGNORECASE), c)
    for p, c in (
        (
            r"out of memory|CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation|\bOOM\b",
            worker_pb2.ERROR_CLASS_OUT_OF_MEMORY,
        ),
        (
            r"illegal memory access|unspecified launch failure|CUDA_ERROR_LAUNCH_FAILED|cudaErrorLaunchFailure|"
            r"device-side assert|uncorrectable ECC|CUDA_ERROR_ECC_UNCORRECTABLE|\bXid\b|GPU is lost|"
            r"CUDA driver (error|version)|CUDA error: unknown error",
            worker_pb2.ERROR_CLASS_DEVICE_LOST,
        ),
        (
            r"exceeds the available context size|invalid request|invalid_request_error|"
            r"maximum context length|must be (greater|less|positive|a)|unexpected inference input",
            worker_pb2.ERROR_CLASS_INVALID_REQUEST,
        ),
        (r"unknown model|has no available versions", worker_pb2.ERROR_CLASS_MODEL_NOT_FOUND),
        (r"deadline exceeded|timed out|timeout", worker_pb2.ERROR_CLASS_TIMEOUT),
        (
            r"not ready|unavailable|connect|socket closed|stub process .* is not healthy",
            worker_pb2.ERROR_CLASS_UNAVAILABLE,
        ),
    )
)


def classify_backend_message(message: str) -> worker_pb2.ErrorClass:
    """Return the ``ErrorClass`` for a backend's error text (BACKEND when unknown)."""
    for pattern, error_class in _BACKEND_PATTERNS:
        if pattern.search(message):
            return error_class
    return worker_pb2.ERROR_CLASS_BACKEND


def from_generation_error(error: worker_pb2.GenerationError, worker: str = "") -> MeshError:
    """Turn a worker's typed error into the caller-facing exception (reason: its error class, e.g. OUT_OF_MEMORY)."""
    reason = label(error.error_class, worker_pb2.ErrorClass).upper()
    return ERROR_CLASS_TO_EXCEPTION.get(error.error_class, Internal)(
        error.message, reason=reason, metadata={"worker": worker} if worker else None
    )


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
