"""A lean HTTP/1.1 client for streamed responses: keep-alive connections, httptools' C parser.

A benchmark's client must cost less than what it measures. httpx (pure-Python
h11 and anyio streams under it) added about 2 ms to every time to first
token on this machine, more than the gateway under test, and its CPU per
event competes with the servers on a small machine; this client adds about
0.1 ms. It speaks only what the OpenAI target needs: one request at a time
per connection, a JSON body, a response body read as it arrives
(Content-Length or chunked).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import urllib.parse
from collections.abc import AsyncIterator

import httptools


class Http1Error(ConnectionError):
    """The connection failed or the server's response is not HTTP/1.1 as it should be."""


class Response:
    """One response, its body read as it arrives (httptools calls the ``on_*`` methods while parsing)."""

    status: int
    headers: dict[str, str]
    """Lower-case names."""
    complete: bool
    """The whole body arrived."""
    _reader: asyncio.StreamReader
    _parser: httptools.HttpResponseParser
    _pieces: list[bytes]
    _headers_done: bool
    _reusable: bool

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.status = 0
        self.headers = {}
        self.complete = False
        self._reader = reader
        self._parser = httptools.HttpResponseParser(self)
        self._pieces = []
        self._headers_done = False
        self._reusable = False

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:  # noqa: D102
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:  # noqa: D102
        self._headers_done = True
        self.status = self._parser.get_status_code()
        # Asked now: once the message is complete the parser has moved on to the next one.
        self._reusable = bool(self._parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:  # noqa: D102
        self._pieces.append(body)

    def on_message_complete(self) -> None:  # noqa: D102
        self.complete = True

    @property
    def keep_alive(self) -> bool:
        """The connection may carry another request."""
        return self.complete and self._reusable

    async def _fill(self) -> None:
        data = await self._reader.read(65536)
        if not data:
            raise Http1Error("the server closed the connection before the response was complete")
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            raise Http1Error(f"the server's response is not valid HTTP/1.1: {exc}") from None

    async def start(self) -> None:
        """Read until the status line and headers arrived."""
        while not self._headers_done:
            await self._fill()

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives (de-chunked), piece by piece."""
        while True:
            if self._pieces:
                joined = b"".join(self._pieces)
                self._pieces.clear()
                yield joined
            if self.complete:
                return
            await self._fill()

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([piece async for piece in self.pieces()])


class Http1Client:
    """Requests to one HTTP(S) origin over a pool of keep-alive connections.

    Args:
        base_url: ``http://host:port/prefix``; request paths are appended to the prefix.
        headers: sent with every request (e.g. Authorization).
        connect_timeout_s: how long opening a connection may take.

    """

    _host: str
    _port: int
    _ssl: ssl.SSLContext | None
    _prefix: str
    _fixed: bytes
    _idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]
    connect_timeout_s: float

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, connect_timeout_s: float = 5.0) -> None:
        url = urllib.parse.urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"{base_url!r} is not an http:// or https:// URL")
        self._host = url.hostname
        self._port = url.port or (443 if url.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if url.scheme == "https" else None
        self._prefix = url.path.rstrip("/")
        host = f"[{self._host}]" if ":" in self._host else self._host
        lines = [
            f"Host: {host}:{self._port}",
            "User-Agent: tokenmesh-bench",
            *(f"{k}: {v}" for k, v in (headers or {}).items()),
        ]
        self._fixed = "".join(f"{line}\r\n" for line in lines).encode("latin-1")
        self._idle = []
        self.connect_timeout_s = connect_timeout_s

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.wait_for(
                asyncio.open_connection(self._host, self._port, ssl=self._ssl), self.connect_timeout_s
            )
        except (OSError, TimeoutError) as exc:
            raise Http1Error(f"cannot connect to {self._host}:{self._port}: {exc!r}") from None

    @contextlib.asynccontextmanager
    async def request(
        self, method: str, path: str, body: bytes = b"", content_type: str = "application/json"
    ) -> AsyncIterator[Response]:
        """Send one request; the response once its headers arrived (its body read inside the block)."""
        head = (
            f"{method} {self._prefix}{path} HTTP/1.1\r\n".encode("latin-1")
            + self._fixed
            + f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n".encode("latin-1")
        )
        while True:
            reused = bool(self._idle)
            reader, writer = self._idle.pop() if reused else await self._connect()
            response = Response(reader)
            try:
                writer.write(head + body)
                await response.start()
            except OSError:  # Http1Error too
                writer.close()
                if reused:
                    continue  # a kept connection the server closed while it was idle: the next, or a new one
                raise
            break
        try:
            yield response
        finally:
            if response.keep_alive:
                self._idle.append((reader, writer))
            else:
                writer.close()

    async def close(self) -> None:
        """Close the kept connections."""
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()
