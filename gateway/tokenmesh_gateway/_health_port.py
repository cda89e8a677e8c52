"""``GET /health`` alone, plaintext HTTP, on a port of its own (``--health-port``) for the kubelet's probes.

The kubelet's HTTP probes present no client certificate, so with ``--tls-mode mtls`` they cannot reach
``/health`` on the HTTPS port; the other services serve their gRPC health on a plaintext port for the same
reason. One request per connection, answered and closed: a probe needs no more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 5.0
"""A connection that has not sent its request line and headers by then is closed."""
MAX_HEAD_BYTES = 8 * 1024
"""A longer request head is closed unanswered (a probe sends a few hundred bytes)."""


class HealthPort:
    """The health listener: 200 ``{"status":"ok"}`` while serving, 503 ``{"status":"draining"}`` once draining.

    Args:
        draining: whether the gateway is draining (read at each request).

    """

    _draining: Callable[[], bool]
    _server: asyncio.Server | None
    port: int
    """The bound port (after :meth:`start`)."""

    def __init__(self, draining: Callable[[], bool]) -> None:
        self._draining = draining
        self._server = None
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        """Listen on host:port (OSError naming the flag when it is taken)."""
        try:
            self._server = await asyncio.start_server(
                self._answer, host.strip("[]"), port, limit=MAX_HEAD_BYTES, reuse_address=True
            )
        except OSError as exc:
            raise OSError(
                f"cannot serve health on {host}:{port} ({exc.strerror or exc}); choose another --health-port "
                "(0 turns it off)"
            ) from None
        self.port = int(self._server.sockets[0].getsockname()[1])
        log.info("gateway health on http://%s:%d/health", host, self.port)

    async def close(self) -> None:
        """Stop listening (a probe being answered finishes)."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            method, _, rest = head.partition(b" ")
            path = rest.partition(b" ")[0].partition(b"?")[0]
            if path != b"/health":
                status, body = b"404 Not Found", b'{"status":"not found: this port serves GET /health alone"}'
            elif method not in (b"GET", b"HEAD"):
                status, body = b"405 Method Not Allowed", b'{"status":"use GET"}'
            elif self._draining():
                status, body = b"503 Service Unavailable", b'{"status":"draining"}'
            else:
                status, body = b"200 OK", b'{"status":"ok"}'
            writer.write(
                b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
                % (status, len(body), b"" if method == b"HEAD" else body)
            )
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a half request or a closed connection: nothing to answer
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
