"""The gateway's lifecycle: listen, serve, drain, stop — :class:`~tokenmesh.lifecycle.Lifecycle` on uvicorn.

uvicorn serves the ASGI app with httptools on the running (uv)loop; we bind
the socket (port 0 works, a taken port is a clean error) and drive uvicorn's
startup, main loop and shutdown ourselves, without its signal handling:
SIGTERM drains first (``/health`` 503, new generations 503, open streams get
``drain_grace_s``, then ``drain_tail_s`` to write their error event), then
uvicorn stops, giving what is left ``stop_grace_s``. uvicorn's main loop and
the certificate renewals are supervised tasks: one that dies stops the
gateway, which exits 1. Its metrics (``--metrics-port``) and its probes' ``/health``
(``--health-port``) have ports of their own, as the other services' do, never the public one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
from typing import TYPE_CHECKING

from tokenmesh.client import Client
from tokenmesh.lifecycle import Lifecycle
from tokenmesh.metrics import MetricsEndpoint
from tokenmesh.server import write_ready_file
from tokenmesh.tls import Tls
from tokenmesh.tracing import Tracing
from tokenmesh_gateway._app import GatewayApp
from tokenmesh_gateway._auth import load_keys
from tokenmesh_gateway._config import GatewayConfig
from tokenmesh_gateway._health_port import HealthPort

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)


class Gateway(Lifecycle):
    """One gateway process: an HTTP server over a :class:`~tokenmesh.client.Client` of the routers.

    Args:
        config: the gateway's settings.

    """

    config: GatewayConfig
    app: GatewayApp | None
    client: Client | None
    tracing: Tracing | None
    _tls: Tls
    """The gateway's certificate files, for its calls to routers."""
    port: int
    """The bound port (after :meth:`start`)."""
    _server: uvicorn.Server | None
    _socket: socket.socket | None
    _main_loop: asyncio.Task[None] | None
    metrics_endpoint: MetricsEndpoint | None
    """``/metrics`` on ``--metrics-port`` (None when 0)."""
    health_port: HealthPort | None
    """``/health`` alone, plaintext, on ``--health-port`` (None when 0)."""

    def __init__(self, config: GatewayConfig) -> None:
        super().__init__(drain_grace_s=config.drain_grace_s, stop_grace_s=config.stop_grace_s)
        self.config = config
        self.app = None
        self.client = None
        self.tracing = None
        self._tls = Tls(config)
        self.port = 0
        self._server = None
        self._socket = None
        self._main_loop = None
        self.metrics_endpoint = None
        self.health_port = None

    @property
    def address(self) -> str:
        """host:port the gateway listens on (after start); an IPv6 host in brackets."""
        host = self.config.host
        return f"[{host}]:{self.port}" if ":" in host and not host.startswith("[") else f"{host}:{self.port}"

    @property
    def url(self) -> str:
        """The OpenAI base URL, ``http(s)://host:port/v1``."""
        return f"{'https' if self.config.tls_mode != 'off' else 'http'}://{self.address}/v1"

    async def _start(self) -> None:
        """Listen and serve."""
        cfg = self.config
        keys = load_keys(cfg.api_keys_file) if cfg.api_keys_file else None
        self.tracing = Tracing("gateway")
        # To the routers as the gateway identity (mtls), verifying them (tls and mtls); RPC spans while tracing.
        self.client = Client(
            cfg.routers,
            retry_deadline_s=cfg.retry_deadline_s,
            max_resumes=cfg.max_resumes,
            credentials=self._tls.credentials(),
            server_name=cfg.tls_server_name,
            tracing=self.tracing,
        )
        if cfg.tls_mode != "off":
            self.spawn(self._follow_certificates(), "certificate renewals")
        self.app = GatewayApp(self.client, cfg, keys)
        self.app.front.tracer = self.tracing.tracer
        if cfg.metrics_port:
            self.metrics_endpoint = MetricsEndpoint(self.app.registry, cfg.host, cfg.metrics_port, "gateway")
        self._socket = _listen(cfg.host, cfg.port)
        self.port = int(self._socket.getsockname()[1])
        server = self._server = self._uvicorn(self.app)
        await server.startup(sockets=[self._socket])
        self._main_loop = self.spawn(server.main_loop(), "uvicorn")
        if cfg.health_port:
            app = self.app
            self.health_port = HealthPort(lambda: app.front.draining)
            await self.health_port.start(cfg.host, cfg.health_port)
        log.info(
            "gateway serving on %s (routers %s)%s",
            self.url,
            ",".join(cfg.routers),
            ", API keys required" if keys else "",
        )
        write_ready_file(cfg.ready_file, address=self.address, url=self.url, pid=os.getpid())

    def _uvicorn(self, app: GatewayApp) -> uvicorn.Server:
        """The uvicorn server for app, set up but not started (its startup binds nothing: the socket is ours)."""
        import uvicorn  # here: every `tokenmesh` command builds the parser that imports this package

        from tokenmesh_gateway._protocol import bounded

        cfg = self.config
        https = cfg.tls_mode != "off"  # HTTPS; with mtls callers must present a certificate the CA signed
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                http=bounded(cfg.max_header_bytes),
                ws="none",
                lifespan="off",
                interface="asgi3",
                access_log=False,
                log_config=None,
                proxy_headers=False,
                server_header=False,
                timeout_graceful_shutdown=cfg.stop_grace_s,  # type: ignore[arg-type]  # an int in its hints, a wait_for timeout in use
                ssl_certfile=cfg.tls_cert if https else None,
                ssl_keyfile=cfg.tls_key if https else None,
                ssl_ca_certs=cfg.tls_ca if https else None,
                ssl_cert_reqs=ssl.CERT_REQUIRED if cfg.tls_mode == "mtls" else ssl.CERT_NONE,
            )
        )
        server.config.load()
        server.lifespan = server.config.lifespan_class(server.config)
        return server

    async def _follow_certificates(self) -> None:
        """Renewed certificate files reach the HTTPS port's new handshakes and the calls to routers."""
        async for _ in self._tls.renewals():
            self._renew_https()
            if self.client is not None:
                credentials = self._tls.credentials()
                assert credentials is not None
                self.client.renew(credentials)
                log.info("TLS certificate files changed: new channels to the routers")

    def _renew_https(self) -> None:
        """New HTTPS handshakes present the renewed certificate and trust the renewed CA; open connections go on.

        uvicorn's listening socket holds one SSL context for its life, so the files are loaded into that context.
        They are tried on a context of their own first: a certificate and key that do not match yet (read
        between the renewer's writes) leave the one in force untouched until the files change again.
        """
        context = self._server.config.ssl if self._server is not None else None
        if context is None:
            return
        cfg = self.config
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cfg.tls_cert, cfg.tls_key)
            context.load_cert_chain(cfg.tls_cert, cfg.tls_key)
            context.load_verify_locations(cfg.tls_ca)
        except (ssl.SSLError, OSError) as exc:
            log.warning("TLS certificate files changed but do not load (%s); the HTTPS port keeps its certificate", exc)
            return
        log.info("TLS certificate files changed: new HTTPS connections get the renewed certificate")

    async def _set_ready(self, ready: bool) -> None:
        """Not ready: /health answers 503 and new generations get 503 (ready again it never becomes)."""
        if self.app is not None and not ready:
            self.app.front.draining = True

    async def _drain(self) -> None:
        """Open exchanges finish within drain_grace_s (the rest end with an error event), then uvicorn stops."""
        if self.app is not None:
            log.info("gateway: %d exchanges open", len(self.app.front.exchanges.active))
            await self.app.front.exchanges.drain(self.config.drain_grace_s, self.config.drain_tail_s)
            # Background responses run on in the workers for their resume grace: any gateway's retrieve adopts them.
            await self.app.responses.store.close()
        if self._server is not None:
            self._server.should_exit = True
            if self._main_loop is not None:
                await asyncio.wait({self._main_loop})  # a loop that died is the failure already; no raise here

    async def _stop(self) -> None:
        """The uvicorn server closes the socket and gives the answers still being written stop_grace_s."""
        if self._server is not None and self._server.started:
            await self._server.shutdown(sockets=[self._socket] if self._socket else None)

    async def _close(self) -> None:
        if self.app is not None:
            await self.app.responses.store.close()  # idempotent; here for a start that failed before the drain
        if self.health_port is not None:
            await self.health_port.close()
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.close()
        if self._socket is not None:
            self._socket.close()
        if self.client is not None:
            await self.client.close()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)


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
        raise OSError(
            f"cannot listen on {host}:{port} ({exc.strerror}); choose another --port (0 picks a free one)"
        ) from None
    sock.setblocking(False)
    return sock
