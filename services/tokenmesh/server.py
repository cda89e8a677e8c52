"""What every tokenmesh gRPC server shares: channel options, health, reflection, errors, ready file."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from grpc_reflection.v1alpha._async import ReflectionServicer as _AsyncReflectionServicer

from tokenmesh.errors import ErrorInterceptor
from tokenmesh.health import LIVENESS, NOT_SERVING, SERVING, HealthServicer
from tokenmesh.tls import Tls
from tokenmesh.tracing import Tracing, server_interceptors

log = logging.getLogger(__name__)

# Long-lived streams (generations of minutes, stats, weight pushes) must survive
# idle proxies and notice dead peers: keepalive pings every 10 s, answered
# within 5 s, allowed without active calls.
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 8 * 1024 * 1024),
    ("grpc.max_send_message_length", 8 * 1024 * 1024),
)
# The router's channels to workers: a small per-stream window (no BDP growth)
# so that a router that falls behind a stream holds the worker back, and the
# worker merges the chunks waiting for it into one message (exact seq; see
# Record.append) instead of gRPC buffering them one by one.
WORKER_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    *CHANNEL_OPTIONS,
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", 4096),
)
# The router's Worker/Link calls (one per worker, every generation on one
# HTTP/2 stream), each on a channel of its own: a large fixed window, so that
# the link is never held back by HTTP/2 flow control; backpressure per
# generation is the link's credit (the worker merges what a slow caller has not
# taken). The per-generation calls stay on WORKER_CHANNEL_OPTIONS.
LINK_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    *CHANNEL_OPTIONS,
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", 1024 * 1024),
)
SERVER_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 8 * 1024 * 1024),
    ("grpc.max_send_message_length", 8 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
)


class ReflectionServicer(_AsyncReflectionServicer):  # type: ignore[misc]
    """Server reflection that also resolves method names (``grpcurl describe pkg.Svc.Method``).

    The C-backed protobuf pool finds services and messages but not methods, so
    a method's file is looked up through its service.
    """

    def _file_containing_symbol(self, request: Any, fully_qualified_name: str) -> Any:
        try:
            self._pool.FindFileContainingSymbol(fully_qualified_name)
        except KeyError:
            parent, _, method = fully_qualified_name.rpartition(".")
            try:
                service = self._pool.FindServiceByName(parent)
            except KeyError:
                service = None
            if service is not None and method in service.methods_by_name:
                fully_qualified_name = parent
        return super()._file_containing_symbol(request, fully_qualified_name)


class ServiceHost:
    """A grpc.aio server with the error interceptor, health and reflection.

    Health starts with ``liveness`` SERVING and everything else NOT_SERVING;
    the owner calls :meth:`set_ready` once it can take work, and again (False)
    when it drains. Only :meth:`stop` turns liveness off.

    Args:
        host: address to listen on.
        port: port to listen on; 0 picks a free one (see :attr:`port` after start).
        service_names: the full names of the services added to :attr:`server` (health answers for each).
        shared_port: other processes may listen on the same port (SO_REUSEPORT; the kernel spreads
            connections over them), and this server also listens on a private loopback port.
        health_port: also serve ``grpc.health.v1`` alone, plaintext, on this port (0: not).
        tls: TLS (or mutual TLS, with per-RPC identity checks) on the main port; the health port stays plaintext.
        max_streams_per_connection: HTTP/2 streams one client connection may have open at once (0: gRPC's default).
        tracing: the service's tracing: while on, every call on the main port gets an RPC span (the health-only
            port's kubelet probes do not).

    """

    server: grpc.aio.Server
    health: HealthServicer
    port: int
    """The bound port (after :meth:`start`)."""
    private_address: str
    """With shared_port: this process's own loopback address (after :meth:`start`)."""
    tls: Tls | None
    """The main port's TLS (None: plaintext)."""
    health_server: grpc.aio.Server | None
    """The plaintext health-only server (None without a health port)."""
    _names: list[str]

    def __init__(  # wide: keyword-only options, each with a default
        self,
        host: str,
        port: int,
        service_names: Iterable[str],
        *,
        shared_port: bool = False,
        health_port: int = 0,
        tls: Tls | None = None,
        max_streams_per_connection: int = 0,
        tracing: Tracing | None = None,
    ) -> None:
        options = SERVER_OPTIONS
        if max_streams_per_connection:
            options = (*options, ("grpc.max_concurrent_streams", max_streams_per_connection))
        if shared_port:
            options = (*(o for o in SERVER_OPTIONS if o[0] != "grpc.so_reuseport"), ("grpc.so_reuseport", 1))
        self.tls = tls if tls is not None and tls.on else None
        authorize = self.tls.authorize if self.tls is not None and self.tls.mode == "mtls" else None
        # The span's interceptor first, so it sees the status the error interceptor sets (and an unauthorized peer).
        interceptors = [*server_interceptors(tracing), ErrorInterceptor(authorize)]
        self.server = grpc.aio.server(interceptors=interceptors, options=options)
        self._shared_port = shared_port
        self.private_address = ""
        self._names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        self.health = HealthServicer(self._names)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        # Kubelet's gRPC probes present no client certificate and need no other
        # service: one servicer answers on both servers, so they never disagree.
        self.health_server = None
        self._health_port = health_port
        if health_port:
            self.health_server = grpc.aio.server(options=options)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            ReflectionServicer([*self._names, reflection.SERVICE_NAME]), self.server
        )
        self._host = host
        self._requested_port = port
        self.port = 0

    @property
    def address(self) -> str:
        """host:port the server listens on (after start)."""
        return f"{self._host}:{self.port}"

    async def start(self) -> int:
        """Bind and start (live, not ready); return the bound port (useful with port 0)."""
        try:
            self.port = self._bind(f"{self._host}:{self._requested_port}")
        except RuntimeError:  # grpc raises when it cannot bind (older releases returned 0)
            self.port = 0
        if self.port == 0:
            raise OSError(
                f"cannot listen on {self._host}:{self._requested_port} (in use or not permitted); "
                "choose another --port (0 picks a free one)"
            )
        if self._shared_port:
            self.private_address = f"127.0.0.1:{self._bind('127.0.0.1:0')}"
        if self.health_server is not None:
            try:
                bound = self.health_server.add_insecure_port(f"{self._host}:{self._health_port}")
            except RuntimeError:
                bound = 0
            if bound == 0:
                raise OSError(
                    f"cannot listen on {self._host}:{self._health_port} for health (in use or not "
                    "permitted); choose another --health-port"
                )
            await self.health_server.start()
        await self.server.start()
        await self.health.set(LIVENESS, SERVING)
        return self.port

    def _bind(self, address: str) -> int:
        if self.tls is None:
            return self.server.add_insecure_port(address)
        return self.server.add_secure_port(address, self.tls.server_credentials())

    async def set_ready(self, ready: bool) -> None:
        """Readiness, overall and per-service health: SERVING when ready (liveness is left alone)."""
        status = SERVING if ready else NOT_SERVING
        for name in self.health.names:
            if name != LIVENESS:
                await self.health.set(name, status)

    async def stop(self, grace: float) -> None:
        """Not ready, not live; stop accepting calls; let running ones finish within grace, then end them."""
        await self.set_ready(False)
        await self.health.set(LIVENESS, NOT_SERVING)
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(0)


def write_ready_file(path: str | None, **info: Any) -> None:
    """Atomically write ``info`` as JSON to path (how parents learn our port)."""
    if not path:
        return
    target = Path(path)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, target)
