"""Statuses on the wire: a ``google.rpc.Status`` (with its details) to and from the taxonomy's errors."""

from __future__ import annotations

import logging
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from tokenmesh.errors._taxonomy import _BY_CODE, FieldViolation, Internal, MeshError

log = logging.getLogger(__name__)


class _Call(Protocol):
    def code(self) -> grpc.StatusCode: ...
    def details(self) -> str | None: ...
    def trailing_metadata(self) -> Any: ...


def from_rpc_error(error: grpc.aio.AioRpcError | _Call) -> MeshError:
    """The mesh's error for a gRPC status a peer sent: the inverse of the taxonomy's codes, with its details.

    The message is the peer's; ``reason``, ``domain`` and ``metadata`` come
    from ``ErrorInfo``, ``field_violations`` from ``BadRequest``,
    ``retry_delay`` from ``RetryInfo`` (decoded as google-api-core does; a
    status without details has ``domain`` ""). Codes with no class of their
    own (UNKNOWN, DATA_LOSS...) become :class:`Internal` with the
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
