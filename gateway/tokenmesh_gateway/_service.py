"""The gateway's lifecycle: listen, serve, drain, stop — the same contract as every tokenmesh service.

uvicorn serves the ASGI app with httptools on the running (uv)loop; we bind
the socket (port 0 works, a taken port is a clean error) and drive uvicorn's
startup, main loop and shutdown ourselves, without its signal handling:
SIGTERM drains first (``/health`` 503, new generations 503, open streams get
``drain_grace_s``), then uvicorn stops.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
from types import TracebackType
from typing import TYPE_CHECKING, Self

from tokenmesh.client import Client
from tokenmesh.lifecycle import serve_until_signal
from tokenmesh.server import write_ready_file
from tokenmesh.tls import Tls
from tokenmesh.tracing import Tracing
from tokenmesh_gateway._app import GatewayApp
from tokenmesh_gateway._auth import load_keys
from tokenmesh_gateway._config import GatewayConfig

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)

STOP_GRACE_S = 2
"""After the drain, how long uvicorn gives what is left (answers being written) before it cancels them."""


class Gateway:
    """One gateway process: an HTTP server over a :class:`~tokenmesh.client.Client` of the routers.

    Args:
        config: the gateway's settings.

    """

    config: GatewayConfig
    app: GatewayApp | None
    client: Client | None
    tracing: Tracing | None
    _renewals: asyncio.Task[None] | None
    _tls: Tls
    """The gateway's certificate files, for its calls to routers."""
    port: int
    """The bound port (after :meth:`start`)."""
    _server: uvicorn.Server | None
    _socket: socket.socket | None
    _main_loop: asyncio.Task[None] | None
    _started: bool
    _shutdown_task: asyncio.Task[None] | None

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.app = None
        self.client = None
        self.tracing = None
        self._renewals = None
        self._tls = Tls(config)
        self.port = 0
        self._server = None
        self._socket = None
        self._main_loop = None
        self._started = False
        self._shutdown_task = None

    @property
    def address(self) -> str:
        """host:port the gateway listens on (after start); an IPv6 host in brackets."""
        host = self.config.host
        return f"[{host}]:{self.port}" if ":" in host and not host.startswith("[") else f"{host}:{self.port}"

    @property
    def url(self) -> str:
        """The OpenAI base URL, ``http(s)://host:port/v1``."""
        return f"{'https' if self.config.tls_mode != 'off' else 'http'}://{self.address}/v1"

    async def start(self) -> None:
        """Listen and serve; a failed start releases what it took, then raises."""
        if self._started:
            raise RuntimeError("gateway was started already; make a new one")
        self._started = True
        try:
            keys = load_keys(self.config.api_keys_file) if self.config.api_keys_file else None
            cfg = self.config
            # To the routers as the gateway identity (mtls), verifying them (tls and mtls).
            self.client = Client(cfg.routers, retry_deadline_s=cfg.retry_deadline_s, max_resumes=cfg.max_resumes,
                                 credentials=self._tls.credentials(), server_name=cfg.tls_server_name)
            if cfg.tls_mode != "off":
                self._renewals = asyncio.create_task(self._follow_certificates(), name="gateway:certificates")
            self.tracing = Tracing("gateway")
            self.app = GatewayApp(self.client, self.config, keys)
            self.app.tracer = self.tracing.tracer
            self._socket = _listen(self.config.host, self.config.port)
            self.port = int(self._socket.getsockname()[1])
            import uvicorn  # here: every `tokenmesh` command builds the parser that imports this package

            from tokenmesh_gateway._protocol import bounded

            https = cfg.tls_mode != "off"  # HTTPS; with mtls callers must present a certificate the CA signed
            server = self._server = uvicorn.Server(uvicorn.Config(
                self.app, http=bounded(cfg.max_header_bytes), ws="none", lifespan="off", interface="asgi3",
                access_log=False, log_config=None, proxy_headers=False, server_header=False,
                timeout_graceful_shutdown=STOP_GRACE_S,
                ssl_certfile=cfg.tls_cert if https else None, ssl_keyfile=cfg.tls_key if https else None,
                ssl_ca_certs=cfg.tls_ca if https else None,
                ssl_cert_reqs=ssl.CERT_REQUIRED if cfg.tls_mode == "mtls" else ssl.CERT_NONE,
            ))
            server.config.load()
            server.lifespan = server.config.lifespan_class(server.config)
            await server.startup(sockets=[self._socket])
            self._main_loop = asyncio.create_task(server.main_loop(), name="gateway:uvicorn")
            log.info("gateway serving on %s (routers %s)%s", self.url, ",".join(self.config.routers),
                     ", API keys required" if keys else "")
            write_ready_file(self.config.ready_file, address=self.address, url=self.url, pid=os.getpid())
        except BaseException:
            await self.shutdown()
            raise

    async def _follow_certificates(self) -> None:
        """Renewed certificate files reach the calls to routers.

        The HTTPS port keeps its certificate until a restart: uvicorn reads it once.
        """
        async for _ in self._tls.renewals():
            if self.client is not None:
                credentials = self._tls.credentials()
                assert credentials is not None
                self.client.renew(credentials)
                log.info("TLS certificate files changed: new channels to the routers")

    async def shutdown(self) -> None:
        """Drain and stop. Idempotent: a second caller waits for the first shutdown to finish."""
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.create_task(self._shutdown())
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self) -> None:
        if self._renewals is not None:
            self._renewals.cancel()
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            if self.app is not None:
                self.app.draining = True
                log.info("gateway draining (grace %g s, %d open)", self.config.drain_grace_s,
                         len(self.app.exchanges.active))
                await self.app.exchanges.drain(self.config.drain_grace_s)
            if self._server is not None:
                self._server.should_exit = True
                if self._main_loop is not None:
                    await self._main_loop
                if self._server.started:
                    await self._server.shutdown(sockets=[self._socket] if self._socket else None)
        finally:
            if self._socket is not None:
                self._socket.close()
            if self.client is not None:
                await self.client.close()
            if self.tracing is not None:
                await asyncio.to_thread(self.tracing.shutdown)
            log.info("gateway stopped %.1f s after draining began", loop.time() - began)

    async def run(self) -> int:
        """Start, serve until SIGTERM or SIGINT (or until the server dies), then shut down; the exit code."""
        async def server_stopped() -> None:
            assert self._main_loop is not None
            await asyncio.wait({self._main_loop})  # cancelling this wait leaves the server's task alone

        if not await serve_until_signal(self.start, server_stopped, self.shutdown):
            return 0
        assert self._main_loop is not None
        log.error("gateway: the HTTP server stopped on its own (%s); exiting",
                  self._main_loop.exception() if not self._main_loop.cancelled() else "cancelled")
        return 1

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.shutdown()


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (an IPv6 host with or without brackets)."""
    bare = host.strip("[]")
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((bare, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({exc.strerror}); choose another --port "
                      "(0 picks a free one)") from None
    sock.setblocking(False)
    return sock
