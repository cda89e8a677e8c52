"""The few ASGI pieces the gateway needs: headers, a bounded body, JSON and error responses.

Raw ASGI rather than a framework: the hot path (one ``send`` per chunk) runs
no middleware and no per-message wrapper.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from tokenmesh_gateway._errors import OPENAI_ERRORS, ErrorShape, HttpError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
"""Event streams are not cached, and nginx-style proxies must pass each event on at once."""
KEEPALIVE = b": keep-alive\n"
"""A lone SSE comment line: every SSE parser skips it (see ``_sse`` for why no blank line follows)."""


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of a request header (name in lower case), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body; 413 as soon as it is known to be over limit bytes."""
    length = header(scope, b"content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _too_large(int(length), limit)
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionResetError("the caller went away while sending its request")
        body = message.get("body", b"")
        size += len(body)
        if size > limit:
            raise _too_large(size, limit)
        parts.append(body)
        if not message.get("more_body", False):
            return b"".join(parts)


def _too_large(size: int, limit: int) -> HttpError:
    return HttpError(
        413, f"the request body is {size} bytes or more; the limit is {limit} bytes", code="request_too_large"
    )


async def respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """A complete JSON response."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*JSON_HEADERS, (b"content-length", str(len(body)).encode()), *(headers or [])],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def respond_error(send: Send, error: HttpError, shape: ErrorShape = OPENAI_ERRORS) -> None:
    """The error in the API's shape (OpenAI's by default), with its status and retry hints."""
    extra = error.headers()
    if error.status == 413:
        extra.append((b"connection", b"close"))  # the rest of the body is never read
    await respond(send, shape.status(error), shape.body(error), extra)
