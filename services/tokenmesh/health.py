"""``grpc.health.v1.Health`` for every tokenmesh server, with liveness and readiness.

Each server answers for a fixed set of names: ``""`` (overall), its service
names, ``liveness`` and ``readiness``. Kubernetes probes can thus tell
"restart me" (liveness NOT_SERVING: only once the process is stopping for good)
from "send me no work" (readiness NOT_SERVING: starting, draining, or a part
it depends on is down). grpcio-health-checking's ``enter_graceful_shutdown()``
is not used: it turns every name off, liveness too.

Names outside the set get NOT_FOUND from Check and Watch, and allocate nothing:
a caller cannot make the servicer keep state for names it makes up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

LIVENESS = "liveness"
"""SERVING from start until the process stops (also while draining): kubelet's livenessProbe."""
READINESS = "readiness"
"""SERVING only while the server takes new work; NOT_SERVING from the moment draining starts."""


class HealthServicer(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """Check and Watch over a fixed set of names; every watcher hears every change.

    The write to a watcher happens outside the condition's lock: a watcher
    whose write waits (a slow or stuck client) must not hold up the other
    watchers or :meth:`set` (upstream writes while holding it). Conditions
    live as long as the servicer (upstream drops a name's condition when any
    one of its watchers leaves, so the others never hear of a later change).

    Args:
        names: every name this server answers for, besides ``""``, ``liveness`` and ``readiness``.

    """

    _status: dict[str, health_pb2.HealthCheckResponse.ServingStatus.ValueType]
    _conditions: dict[str, asyncio.Condition]

    def __init__(self, names: Iterable[str]) -> None:
        known = ["", LIVENESS, READINESS, *names]
        self._status = dict.fromkeys(known, NOT_SERVING)
        self._conditions = {name: asyncio.Condition() for name in known}

    @property
    def names(self) -> tuple[str, ...]:
        """Every name answered for."""
        return tuple(self._status)

    def status(self, name: str) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
        """The status of a known name (KeyError for others)."""
        return self._status[name]

    async def set(self, name: str, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        """Set one known name's status and wake its watchers."""
        condition = self._conditions[name]  # KeyError: names are fixed at construction
        async with condition:
            self._status[name] = status
            condition.notify_all()

    async def _unknown(self, name: str, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        known = ", ".join(repr(n) for n in self._status)
        await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service name {name!r}; this server answers {known}")

    async def Check(  # noqa: N802 - gRPC method name
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthCheckResponse:
        """The status now."""
        status = self._status.get(request.service)
        if status is None:
            await self._unknown(request.service, context)
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(  # noqa: N802 - gRPC method name
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        """Stream the status now and after every change."""
        condition = self._conditions.get(request.service)
        if condition is None:
            await self._unknown(request.service, context)
            return
        last = None
        while True:
            async with condition:
                while self._status[request.service] == last:
                    await condition.wait()
                status = self._status[request.service]
            last = status
            await context.write(health_pb2.HealthCheckResponse(status=status))
