"""Errors as the OpenAI API sends them: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

The status of a mesh error comes from the one error table
(:attr:`tokenmesh.errors.MeshError.http_status`), the rest from the facts of
its status details (:func:`tokenmesh.errors.from_rpc_error`): ``param`` is
the ``BadRequest`` field violation, ``code`` the ``ErrorInfo`` reason where
OpenAI has a word for it (else the status code's name), and a retry hint
(``RetryInfo``) becomes the ``Retry-After`` (seconds) and ``retry-after-ms``
headers, which the ``openai`` SDK honours when it retries.

An :class:`ErrorShape` writes the error as one API does: OpenAI's here,
Anthropic's in ``_anthropic_sse``; each route says which.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import orjson

from tokenmesh.errors import MeshError, ResourceExhausted, Unavailable, label
from tokenmesh_gateway._ratelimits import refused_headers

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
}
"""OpenAI's error ``type`` per status; any other 4xx is an invalid request, 5xx a server error."""

DEFAULT_RETRY_AFTER_MS = 1000
"""Retry hint of a 503 the router gave none for (no live worker, a draining gateway)."""

QUOTA_REASON = "QUOTA_"
"""What the ErrorInfo reasons of the router's quota refusals begin with (QUOTA_TOKENS_PER_MINUTE...)."""

_CODES = {"UNKNOWN_MODEL": "model_not_found"}
"""OpenAI's ``code`` for the ErrorInfo reasons it has one for; any other error's code is its status code's name."""


class HttpError(Exception):
    """A request that ends in an HTTP error with the OpenAI error body.

    Args:
        status: the HTTP status.
        message: what went wrong and what to change.
        param: the request field at fault, when one is.
        code: a short machine-readable reason (``invalid_argument``, ``model_not_found``...).
        retry_after_ms: a retry hint; sent as ``Retry-After`` (whole seconds, rounded up) and ``retry-after-ms``.
        extra_headers: more headers of the response.

    """

    status: int
    message: str
    param: str | None
    code: str | None
    retry_after_ms: int | None
    extra_headers: list[tuple[bytes, bytes]]
    """More headers (a quota refusal's x-ratelimit-*)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_ms: int | None = None,
        extra_headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.extra_headers = extra_headers or []
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_ms = retry_after_ms

    @property
    def type(self) -> str:
        """OpenAI's error type for the status."""
        return _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def document(self) -> dict[str, Any]:
        """The error object (the value of "error")."""
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}

    def body(self) -> bytes:
        """The JSON body ``{"error": {...}}``."""
        return orjson.dumps({"error": self.document()})

    def headers(self) -> list[tuple[bytes, bytes]]:
        """Retry hints, when there is one, and the extra headers."""
        if self.retry_after_ms is None:
            return list(self.extra_headers)
        seconds = max(1, math.ceil(self.retry_after_ms / 1000))
        return [
            (b"retry-after", str(seconds).encode()),
            (b"retry-after-ms", str(self.retry_after_ms).encode()),
            *self.extra_headers,
        ]


class ErrorShape(Protocol):
    """How one HTTP API writes an error: its status and its body (the retry headers are the same for all)."""

    def status(self, error: HttpError) -> int:
        """The HTTP status this API answers the error with."""
        ...

    def body(self, error: HttpError) -> bytes:
        """The JSON body of the error."""
        ...


class OpenAIErrors:
    """OpenAI's shape: the status as is, ``{"error": {"message", "type", "param", "code"}}``."""

    def status(self, error: HttpError) -> int:
        """The error's own status."""
        return error.status

    def body(self, error: HttpError) -> bytes:
        """``{"error": {...}}``."""
        return error.body()


OPENAI_ERRORS = OpenAIErrors()


def invalid(message: str, param: str | None = None) -> HttpError:
    """400 for a request the gateway itself refuses."""
    return HttpError(400, message, param=param, code="invalid_argument")


def from_mesh(error: MeshError) -> HttpError:
    """The HTTP error for a mesh error: status from the error table, the rest from its details."""
    code = _CODES.get(error.reason) or label(error.grpc_code)
    param = error.field_violations[0].field if error.field_violations else None
    hint = None if error.retry_delay is None else max(0, round(error.retry_delay * 1000))
    quota = error.reason.startswith(QUOTA_REASON)
    if hint is None and isinstance(error, Unavailable | ResourceExhausted) and not quota:
        hint = DEFAULT_RETRY_AFTER_MS  # a quota refusal without one never fits: no retry
    extra = refused_headers(error.metadata) if quota else None
    return HttpError(error.http_status, error.message, param=param, code=code, retry_after_ms=hint, extra_headers=extra)
