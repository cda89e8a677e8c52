"""The router: ``Inference`` for callers, ``Router`` for operators, ``Control`` for the prober."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenmesh.router.admission import Admission
from tokenmesh.router.config import RouterConfig
from tokenmesh.router.inference import InferenceServicer
from tokenmesh.router.pool import WorkerPool
from tokenmesh.server import WORKER_CHANNEL_OPTIONS, Service, ServiceHost, write_ready_file
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

__all__ = ["ControlServicer", "Router", "RouterConfig", "RouterServicer"]


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Operator API."""

    def __init__(self, pool: WorkerPool, admission: Admission) -> None:
        self._pool = pool
        self._admission = admission

    async def GetRoutingTable(  # noqa: N802 - gRPC method name
        self, request: router_pb2.GetRoutingTableRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> router_pb2.RoutingTable:
        """The table in force and per-worker counters."""
        table = self._pool.table()
        table.queued = len(self._admission.waiting)
        return table


class ControlServicer(router_pb2_grpc.ControlServicer):
    """Weight tables from the prober; each version acked."""

    def __init__(self, pool: WorkerPool, on_new_worker: asyncio.Queue[str], admission: Admission) -> None:
        self._pool = pool
        self._new_workers = on_new_worker
        self._admission = admission

    async def PushWeights(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[router_pb2.WeightTable], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[router_pb2.WeightAck]:
        """Apply each newer table; ack every one."""
        async for table in request_iterator:
            known = set(self._pool.entries)
            applied = self._pool.apply(table)
            if applied:
                self._admission.dispatch()  # weights or limits changed: waiters may go now
            for address in set(self._pool.entries) - known:
                self._new_workers.put_nowait(address)
            yield router_pb2.WeightAck(version=table.version, applied=applied)


class Router(Service):
    """Lifecycle of one router: start, ready (SERVING), drain, stop."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.pool = WorkerPool(policy=config.policy)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._new_workers: asyncio.Queue[str] = asyncio.Queue()
        self.admission = Admission(
            self.pool, max_queue=config.max_queue, queue_timeout_s=config.queue_timeout_s, aging_s=config.aging_s
        )
        self.inference = InferenceServicer(config, self.pool, self._stubs, self.admission)
        names = [
            inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,
            router_pb2.DESCRIPTOR.services_by_name["Router"].full_name,
            router_pb2.DESCRIPTOR.services_by_name["Control"].full_name,
        ]
        self.host = ServiceHost(config.host, config.port, names)
        inference_pb2_grpc.add_InferenceServicer_to_server(self.inference, self.host.server)
        router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(self.pool, self.admission), self.host.server)
        control = ControlServicer(self.pool, self._new_workers, self.admission)
        router_pb2_grpc.add_ControlServicer_to_server(control, self.host.server)
        self._adder: asyncio.Task[None] | None = None
        self._dispatcher: asyncio.Task[None] | None = None
        self._stopped = False

    def _watch(self, address: str) -> None:
        if address in self._watchers:
            return
        self.pool.add(address)
        channel = grpc.aio.insecure_channel(address, options=WORKER_CHANNEL_OPTIONS)
        self._channels[address] = channel
        self._stubs[address] = worker_pb2_grpc.WorkerStub(channel)
        self._watchers[address] = asyncio.create_task(self._watch_worker(address, channel))

    async def _watch_worker(self, address: str, channel: grpc.aio.Channel) -> None:
        """Keep entry.healthy and entry.models current from Describe and health Watch."""
        entry = self.pool.entries[address]
        stub = self._stubs[address]
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
                async for update in watch:
                    serving = update.status == health_pb2.HealthCheckResponse.SERVING
                    if serving:
                        described = await stub.Describe(worker_pb2.DescribeRequest(), timeout=5)
                        entry.models = {m.name: m for m in described.models}
                        entry.triton_url = described.triton_url
                        if not entry.limit or not self.pool.version:
                            entry.limit = described.concurrency_limit
                    entry.healthy = serving
                    if not self.pool.version:
                        entry.reason = "health SERVING" if serving else "health NOT_SERVING"
            except grpc.aio.AioRpcError as exc:
                entry.healthy = False
                if not self.pool.version:
                    entry.reason = f"unreachable: {exc.code().name}"
            await asyncio.sleep(0.5)

    async def _add_workers(self) -> None:
        while True:
            self._watch(await self._new_workers.get())

    async def start(self) -> None:
        """Listen, start watching the configured workers, SERVING."""
        await self.host.start()
        for address in self.config.workers:
            self._watch(address)
        self._adder = asyncio.create_task(self._add_workers())
        self._dispatcher = asyncio.create_task(self.admission.run_dispatcher())
        await self.host.set_serving(True)
        log.info("router SERVING on %s with workers %s", self.host.address, ", ".join(self.config.workers) or "-")
        write_ready_file(self.config.ready_file, address=self.host.address, pid=os.getpid())

    async def stop(self) -> None:
        """NOT_SERVING, let in-flight generations finish within the grace period, stop. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        await self.host.stop(grace=self.config.drain_grace_s, busy=lambda: bool(self.inference.live))
        for task in [*self._watchers.values(), self._adder, self._dispatcher]:
            if task is not None:
                task.cancel()
        for channel in self._channels.values():
            await channel.close()
