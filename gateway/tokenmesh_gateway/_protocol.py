"""uvicorn's httptools protocol with a bound on request headers (it has none of its own: 2 MB went through)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEADER_END = b"\r\n\r\n"
LINGER_S = 1.0
"""How long a refused request's remaining bytes are read (and dropped) before the connection closes."""


class BoundedHeaders(HttpToolsProtocol):
    """Answers 431 and closes the connection once a request's line and headers pass max_header_bytes.

    Bytes are counted as they arrive, before the parser buffers them, so a
    caller cannot make the gateway hold more than the limit (plus one read)
    of headers per connection.
    """

    max_header_bytes = 32 * 1024
    """Set per gateway (GatewayConfig.max_header_bytes) on a subclass."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_headers = True
        self._header_bytes = 0
        self._tail = b""
        self._refused = False

    def on_message_begin(self) -> None:
        """A new request: its headers are counted afresh."""
        super().on_message_begin()
        self._in_headers, self._header_bytes, self._tail = True, 0, b""

    def on_headers_complete(self) -> None:
        """The headers are in: what follows is the body."""
        self._in_headers = False
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        """Count the header bytes of this read before the parser sees them."""
        if self._refused:
            return  # the rest of a refused request, read and dropped until the connection closes
        if self._in_headers:
            seen = self._tail + data
            end = seen.find(HEADER_END)
            self._header_bytes += len(data) if end < 0 else max(0, end + len(HEADER_END) - len(self._tail))
            self._tail = seen[-(len(HEADER_END) - 1) :]
            if self._header_bytes > self.max_header_bytes:
                self._refuse()
                return
        super().data_received(data)

    def _refuse(self) -> None:
        body = orjson.dumps(
            {
                "error": {
                    "message": f"request line and headers over {self.max_header_bytes} bytes; send smaller headers",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_header_fields_too_large",
                }
            }
        )
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body
        )
        # Closing with the caller's bytes unread would reset the connection and lose the answer: drop what
        # still comes for a moment (bounded, nothing is kept), then close.
        self._refused = True
        asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)


def bounded(max_header_bytes: int) -> type[BoundedHeaders]:
    """The protocol class for one gateway's limit."""
    return type("BoundedHeaders", (BoundedHeaders,), {"max_header_bytes": max_header_bytes})
