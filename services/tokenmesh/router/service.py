"""The router: ``Inference`` for callers, ``Router`` for operators, ``Control`` for the prober."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenmesh.config import env_name
from tokenmesh.process import dies_with_parent, stop_process
from tokenmesh.router.admission import Admission
from tokenmesh.router.config import RouterConfig
from tokenmesh.router.inference import InferenceServicer
from tokenmesh.router.peers import FORWARDED, Peers
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
        table.process_index, table.processes = self._pool.share
        return table


class ControlServicer(router_pb2_grpc.ControlServicer):
    """Weight tables from the prober; each version acked."""

    def __init__(
        self, pool: WorkerPool, on_new_worker: asyncio.Queue[str], admission: Admission, peers: Peers | None = None
    ) -> None:
        self._pool = pool
        self._new_workers = on_new_worker
        self._admission = admission
        self._peers = peers

    async def PushWeights(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[router_pb2.WeightTable], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[router_pb2.WeightAck]:
        """Apply each newer table (and pass it on to sibling processes); ack every one."""
        from_sibling = FORWARDED in (context.invocation_metadata() or ())
        async for table in request_iterator:
            known = set(self._pool.entries)
            applied = self._pool.apply(table)
            if applied:
                self._admission.dispatch()  # weights or limits changed: waiters may go now
                if self._peers is not None and not from_sibling:
                    self._peers.forward(table)
            for address in set(self._pool.entries) - known:
                self._new_workers.put_nowait(address)
            yield router_pb2.WeightAck(version=table.version, applied=applied)


class Router(Service):
    """Lifecycle of one router: start, ready (SERVING), drain, stop."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.pool = WorkerPool(policy=config.policy, share=(config.process_index, config.processes))
        self.peers: Peers | None = None
        self._siblings: list[subprocess.Popen[bytes]] = []
        self._own_peers_dir: tempfile.TemporaryDirectory[str] | None = None
        if config.processes > 1:
            if not config.peers_dir:
                self._own_peers_dir = tempfile.TemporaryDirectory(prefix="tokenmesh-router-")
            directory = Path(config.peers_dir or self._own_peers_dir.name)  # type: ignore[union-attr]
            self.peers = Peers(directory, config.process_index, config.processes)
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
        self.host = ServiceHost(config.host, config.port, names, shared_port=config.processes > 1)
        inference_pb2_grpc.add_InferenceServicer_to_server(self.inference, self.host.server)
        router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(self.pool, self.admission), self.host.server)
        control = ControlServicer(self.pool, self._new_workers, self.admission, self.peers)
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
        if self.peers is not None:
            self.peers.register(self.host.private_address)
            if self.config.process_index == 0:
                await self._start_siblings()
        await self.host.set_serving(True)
        log.info("router%s SERVING on %s with workers %s",
                 f" process {self.config.process_index + 1}/{self.config.processes}" if self.peers else "",
                 self.host.address, ", ".join(self.config.workers) or "-")
        write_ready_file(self.config.ready_file, address=self.host.address, pid=os.getpid())

    async def _start_siblings(self) -> None:
        """The first process starts the others on the same port, with the same settings."""
        assert self.peers is not None
        env = dict(os.environ)
        for field in dataclasses.fields(self.config):
            value = getattr(self.config, field.name)
            env[env_name("router", field.name)] = ",".join(value) if isinstance(value, tuple) else str(value)
        env[env_name("router", "port")] = str(self.host.port)
        env[env_name("router", "peers_dir")] = str(self.peers.directory)
        env[env_name("router", "ready_file")] = ""
        for index in range(1, self.config.processes):
            env[env_name("router", "process_index")] = str(index)
            self._siblings.append(subprocess.Popen(  # noqa: S603 - our own interpreter and module
                dies_with_parent([sys.executable, "-m", "tokenmesh", "router"]), env=env, stdin=subprocess.DEVNULL))
        try:
            await self.peers.wait_listed(60)
        except TimeoutError as exc:
            raise RuntimeError(f"router processes did not start: {exc}") from None

    async def stop(self) -> None:
        """NOT_SERVING, let in-flight generations finish within the grace period, stop. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        for sibling in self._siblings:
            sibling.terminate()  # each drains its own in-flight generations
        if self.peers is not None:
            self.peers.unregister()
            await self.peers.close()
        await self.host.stop(grace=self.config.drain_grace_s, busy=lambda: bool(self.inference.live))
        self.inference.close_spares()
        for task in [*self._watchers.values(), self._adder, self._dispatcher]:
            if task is not None:
                task.cancel()
        for channel in self._channels.values():
            await channel.close()
        for sibling in self._siblings:
            await asyncio.to_thread(stop_process, sibling, 10.0)
        if self._own_peers_dir is not None:
            self._own_peers_dir.cleanup()
