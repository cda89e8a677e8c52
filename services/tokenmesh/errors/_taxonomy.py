"""The mesh's one error taxonomy: each class knows its gRPC status code and the HTTP status the gateway uses."""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import grpc
from google.protobuf import duration_pb2
from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

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


class Aborted(MeshError):
    """The generation stopped where the mesh cannot continue it exactly; the caller retries it whole."""

    grpc_code = grpc.StatusCode.ABORTED
    http_status = 409


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
    Aborted,
)
"""Every error class; each gRPC code belongs to at most one."""

_BY_CODE: dict[grpc.StatusCode, type[MeshError]] = {cls.grpc_code: cls for cls in ERRORS}
