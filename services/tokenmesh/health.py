"""``grpc.health.v1.Health`` for every tokenmesh server, with liveness and readiness.

Each server answers for a fixed set of names: ``""`` (overall), its service
names, ``liveness`` and ``readiness``. Kubernetes probes can thus tell
"restart me" (liveness NOT_SERVING: only once the process is stopping for good)
from "send me no work" (readiness NOT_SERVING: starting, draining, or a part
it depends on is down). grpcio-health-checking's ``enter_graceful_shutdown()``
is not used: it turns every name off, liveness too.

A name outside the set gets NOT_FOUND from Check; Watch streams
SERVICE_UNKNOWN and keeps the call open (the gRPC health protocol: the name may
appear later, and then its real status follows). Either way it allocates
nothing per name: a caller cannot make the servicer keep state for names it
makes up (a Watch waits on the one condition every new name wakes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN

LIVENESS = "liveness"
"""SERVING from start until the process stops (also while draining): kubelet's livenessProbe."""
READINESS = "readiness"
"""SERVING only while the server takes new work; NOT_SERVING from the moment draining starts."""


class HealthServicer(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """Check and Watch over the names the server sets; every watcher hears every change.

    The write to a watcher happens outside the condition's lock: a watcher
    whose write waits (a slow or stuck client) must not hold up the other
    watchers or :meth:`set` (upstream writes while holding it). Conditions
    live as long as the servicer (upstream drops a name's condition when any
    one of its watchers leaves, so the others never hear of a later change).

    Args:
        names: the names this server answers for from the start, besides ``""``, ``liveness`` and ``readiness``.

    """

    _status: dict[str, health_pb2.HealthCheckResponse.ServingStatus.ValueType]
    _conditions: dict[str, asyncio.Condition]
    _added: asyncio.Condition
    """Notified when :meth:`set` adds a name: the Watch calls on unknown names wait on it."""

    def __init__(self, names: Iterable[str]) -> None:
        known = ["", LIVENESS, READINESS, *names]
        self._status = dict.fromkeys(known, NOT_SERVING)
        self._conditions = {name: asyncio.Condition() for name in known}
        self._added = asyncio.Condition()

    @property
    def names(self) -> tuple[str, ...]:
        """Every name answered for."""
        return tuple(self._status)

    def status(self, name: str) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
        """The status of a known name (KeyError for others)."""
        return self._status[name]

    async def set(self, name: str, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        """Set one name's status and wake its watchers; a new name is answered for from now on (the server's call)."""
        condition = self._conditions.get(name)
        if condition is None:
            condition = self._conditions[name] = asyncio.Condition()
            self._status[name] = status
            async with self._added:
                self._added.notify_all()
            return
        async with condition:
            self._status[name] = status
            condition.notify_all()

    async def Check(  # noqa: N802 - gRPC method name
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthCheckResponse:
        """The status now."""
        status = self._status.get(request.service)
        if status is None:
            known = ", ".join(repr(n) for n in self._status)
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"unknown service name {request.service!r}; this server answers {known}"
            )
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(  # noqa: N802 - gRPC method name
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        """Stream the status now and after every change; SERVICE_UNKNOWN first while the name is not known.

        The call ends only when the caller cancels it, its deadline passes or the server stops.
        """
        name = request.service
        if name not in self._conditions:
            await context.write(health_pb2.HealthCheckResponse(status=SERVICE_UNKNOWN))
            async with self._added:
                await self._added.wait_for(lambda: name in self._conditions)
        condition = self._conditions[name]
        last = None
        while True:
            async with condition:
                while self._status[name] == last:
                    await condition.wait()
                status = self._status[name]
            last = status
            await context.write(health_pb2.HealthCheckResponse(status=status))
