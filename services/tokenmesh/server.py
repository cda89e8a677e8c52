"""What every tokenmesh gRPC server shares: health, reflection, errors, ready file."""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import os
import signal
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer as _AsyncHealthServicer
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from grpc_reflection.v1alpha._async import ReflectionServicer as _AsyncReflectionServicer

from tokenmesh.errors import ErrorInterceptor

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

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
SERVER_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 8 * 1024 * 1024),
    ("grpc.max_send_message_length", 8 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
)


class HealthServicer(_AsyncHealthServicer):  # type: ignore[misc]
    """grpc.health.v1 with every watcher notified.

    The upstream async servicer drops a service's condition when any one of its
    watchers leaves, so the other watchers (the prober and each router watch
    the same worker) would never hear of a later change. Here conditions live
    as long as the servicer.
    """

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]) -> None:  # noqa: N802
        """Stream the status now and after every change.

        The write happens outside the condition's lock: a watcher whose write
        waits (a slow or stuck client) must not hold up the other watchers or
        ``set`` (upstream writes while holding it).
        """
        condition = self._server_watchers[request.service]
        last = None
        while True:
            async with condition:
                status = self._server_status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                while status == last:
                    await condition.wait()
                    status = self._server_status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            last = status
            await context.write(health_pb2.HealthCheckResponse(status=status))


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

    Health starts NOT_SERVING; the owner flips it with :meth:`set_serving`
    once it can take work, and back while draining.
    """

    def __init__(self, host: str, port: int, service_names: Iterable[str], *, shared_port: bool = False) -> None:
        # shared_port: other processes may listen on the same port (SO_REUSEPORT; the kernel
        # spreads connections over them), and this server also listens on a private loopback port.
        options = SERVER_OPTIONS
        if shared_port:
            options = (*(o for o in SERVER_OPTIONS if o[0] != "grpc.so_reuseport"), ("grpc.so_reuseport", 1))
        self.server = grpc.aio.server(interceptors=[ErrorInterceptor()], options=options)
        self._shared_port = shared_port
        self.private_address = ""
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
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
        """Bind and start; return the bound port (useful with port 0)."""
        self.port = self.server.add_insecure_port(f"{self._host}:{self._requested_port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {self._host}:{self._requested_port} (in use or not permitted)")
        if self._shared_port:
            self.private_address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()
        await self.set_serving(False)
        return self.port

    async def set_serving(self, serving: bool) -> None:
        """Set overall and per-service health."""
        status = SERVING if serving else NOT_SERVING
        for name in ["", *self._names]:
            await self.health.set(name, status)

    async def stop(self, grace: float, busy: Callable[[], bool] | None = None) -> None:
        """NOT_SERVING, stop accepting calls, let running ones finish within grace, then end the rest.

        With ``busy``, only the calls it reports (e.g. generations) are waited
        for: long-lived streams such as weight pushes and health watches would
        otherwise hold every stop for the whole grace period.
        """
        await self.set_serving(False)
        if busy is None:
            await self.server.stop(grace)
            return
        stopping = asyncio.create_task(self.server.stop(grace))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while busy() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await self.server.stop(0)
        await stopping


def write_ready_file(path: str | None, **info: Any) -> None:
    """Atomically write ``info`` as JSON to path (how parents learn our port)."""
    if not path:
        return
    target = Path(path)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, target)


class Service(abc.ABC):
    """A service's lifecycle: start (ready when SERVING), stop (drain; idempotent), run."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Listen and become ready."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Drain and release everything; safe to call twice."""

    async def run(self) -> None:
        """Start, serve until SIGTERM or SIGINT, then stop."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await self.start()
            await stop.wait()
        finally:
            await self.stop()
