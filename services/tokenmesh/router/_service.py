"""The router: ``Inference`` for callers, ``Router`` for operators, ``Control`` for the prober."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenmesh.config import env_name
from tokenmesh.discovery import Discovery, DnsResolver
from tokenmesh.lifecycle import Service
from tokenmesh.links import Link, Links, follow_renewals
from tokenmesh.metrics import MetricsEndpoint
from tokenmesh.process import dies_with_parent, stop_process
from tokenmesh.retry import Reconnect, StreamEnded, failure_name
from tokenmesh.router._admission import Admission
from tokenmesh.router._config import RouterConfig
from tokenmesh.router._inference import InferenceServicer
from tokenmesh.router._metrics import RouterMetrics
from tokenmesh.router._peers import FORWARDED, Peers
from tokenmesh.router._pool import WorkerEntry, WorkerPool
from tokenmesh.router._quotas import Quotas
from tokenmesh.router._tables import check_table
from tokenmesh.router._transport import WorkerTransports
from tokenmesh.server import LINK_CHANNEL_OPTIONS, WORKER_CHANNEL_OPTIONS, ServiceHost, write_ready_file
from tokenmesh.tls import Tls
from tokenmesh.tracing import Tracing, rpc_spans_for
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

MODELS_REFRESH_S = 1.0
"""How often the router reads again the Describe of a worker serving LoRA adapters (its loaded set changes)."""


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Operator API.

    Args:
        pool: the workers and the table in force.
        admission: the queue (its length is in the table).
        modes: how generations reach a worker, by address (RoutingEntry.link).

    """

    _pool: WorkerPool
    _admission: Admission
    _modes: Callable[[str], str]

    def __init__(self, pool: WorkerPool, admission: Admission, modes: Callable[[str], str] = lambda _: "") -> None:
        self._pool = pool
        self._admission = admission
        self._modes = modes

    async def GetRoutingTable(  # noqa: N802 - gRPC method name
        self, request: router_pb2.GetRoutingTableRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> router_pb2.RoutingTable:
        """The table in force and per-worker counters."""
        table = self._pool.table()
        table.queued = len(self._admission.waiting)
        table.process_index, table.processes = self._pool.share
        for entry in table.workers:
            entry.link = self._modes(entry.address)
        return table


class ControlServicer(router_pb2_grpc.ControlServicer):
    """Weight tables from the prober; each version checked whole, then applied and acked.

    Args:
        pool: the workers; tables are applied to it.
        on_new_worker: gets each address a table adds (only with adopt).
        allowed: the workers a table may name (None: any).
        adopt: a table may add workers (--discovery prober); otherwise a worker the router does not know is
            passed over.
        metrics: counts the tables and their propagation.
        peers: the sibling processes to pass tables on to (--processes > 1).

    """

    _pool: WorkerPool
    _new_workers: asyncio.Queue[str]
    _allowed: frozenset[str] | None
    _adopt: bool
    _metrics: RouterMetrics
    _peers: Peers | None

    def __init__(
        self,
        pool: WorkerPool,
        on_new_worker: asyncio.Queue[str],
        allowed: frozenset[str] | None,
        adopt: bool,
        metrics: RouterMetrics,
        peers: Peers | None = None,
    ) -> None:
        self._metrics = metrics
        self._pool = pool
        self._new_workers = on_new_worker
        self._allowed = allowed
        self._adopt = adopt
        self._peers = peers

    async def PushWeights(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[router_pb2.WeightTable], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[router_pb2.WeightAck]:
        """Apply each newer table (and pass it on to sibling processes); ack every one.

        A table with a bad entry (a weight outside [0, 1], a malformed address,
        a worker --discovery static does not allow) is not applied at all: the
        stream ends with INVALID_ARGUMENT naming the entry.
        """
        from_sibling = FORWARDED in (context.invocation_metadata() or ())
        async for table in request_iterator:
            check_table(table, self._allowed)
            known = set(self._pool.entries)
            applied = self._pool.apply(table, adopt=self._adopt)  # the admission hears of it from the pool
            self._metrics.tables.labels("yes" if applied else "no").inc()
            if applied and table.HasField("decided_at"):
                self._metrics.propagation.observe(self._pool.propagation_ms / 1000)
            if applied and self._peers is not None and not from_sibling:
                self._peers.forward(table)
            for address in set(self._pool.entries) - known:
                self._new_workers.put_nowait(address)
            yield router_pb2.WeightAck(version=table.version, applied=applied)


class Router(Service):
    """Lifecycle of one router: start, ready (SERVING), drain, stop.

    Draining: readiness goes NOT_SERVING, new generations and resumes get
    UNAVAILABLE (callers retry on another router), in-flight generations (also
    the streams of GenerateStream calls, each call ending once its streams
    have) may finish within ``drain_grace_s``; Cancel keeps working.

    Args:
        config: the router's settings.

    """

    config: RouterConfig
    pool: WorkerPool
    peers: Peers | None
    """The sibling processes of a router run with --processes > 1."""
    admission: Admission
    inference: InferenceServicer
    _siblings: list[subprocess.Popen[bytes]]
    _own_peers_dir: tempfile.TemporaryDirectory[str] | None
    links: Links
    """Per worker: its channel, stubs, health watch and spare Generate call."""
    transports: WorkerTransports
    """The road to each worker (its Link, or per-generation calls): built, told of loss and closed here."""
    _new_workers: asyncio.Queue[str]
    discovery: Discovery | None
    """The worker names' lookups (--discovery dns)."""
    quotas: Quotas
    """The tenants' quotas (--quota-file), counted here or in Redis (--quota-redis-url)."""
    metrics: RouterMetrics
    metrics_endpoint: MetricsEndpoint | None
    tracing: Tracing
    tls: Tls

    def __init__(self, config: RouterConfig) -> None:
        names = [
            inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,
            router_pb2.DESCRIPTOR.services_by_name["Router"].full_name,
            router_pb2.DESCRIPTOR.services_by_name["Control"].full_name,
        ]
        self.tracing = Tracing("router")  # first: the server and every channel take its RPC span interceptors
        self.tls = Tls(config, config.tls_allowed_clients, siblings=config.processes > 1, tracing=self.tracing)
        host = ServiceHost(
            config.host,
            config.port,
            names,
            shared_port=config.processes > 1,
            health_port=config.health_port,
            tls=self.tls,
            max_streams_per_connection=config.max_streams_per_connection,
            tracing=self.tracing,
        )
        super().__init__(host, drain_grace_s=config.drain_grace_s, stop_grace_s=config.stop_grace_s)
        self.config = config
        self.pool = WorkerPool(policy=config.policy, share=(config.process_index, config.processes))
        self.peers = None
        self._siblings = []
        self._own_peers_dir = None
        if config.processes > 1:
            if not config.peers_dir:
                self._own_peers_dir = tempfile.TemporaryDirectory(prefix="tokenmesh-router-")
            directory = Path(config.peers_dir or self._own_peers_dir.name)  # type: ignore[union-attr]
            self.peers = Peers(directory, config.process_index, config.processes, self.tls)
        # Old channels stay open after a renewal: generations on them run to their end.
        self.links = Links(self.tls.channel, WORKER_CHANNEL_OPTIONS, spawn=self.spawn)
        self._new_workers = asyncio.Queue()
        self.admission = Admission(
            self.pool, max_queue=config.max_queue, queue_timeout_s=config.queue_timeout_s, aging_s=config.aging_s
        )
        self.metrics = RouterMetrics(config.metrics_tenants, enabled=bool(config.metrics_port))
        self.metrics_endpoint = None
        self.tls.denied = lambda group: self.metrics.denied.labels(group).inc()
        self.metrics.watch(self.pool, self.admission, self._link_mode)
        self.quotas = self._quotas(config)
        self.transports = self._transports(config)
        self.inference = InferenceServicer(
            config, self.pool, self.transports, self.admission, self.metrics, self.quotas
        )
        self.inference.tracer = self.tracing.tracer
        inference_pb2_grpc.add_InferenceServicer_to_server(self.inference, host.server)
        router_pb2_grpc.add_RouterServicer_to_server(
            RouterServicer(self.pool, self.admission, self._link_mode), host.server
        )
        allowed = frozenset(config.workers) if config.discovery == "static" else None
        control = ControlServicer(
            self.pool, self._new_workers, allowed, config.discovery == "prober", self.metrics, self.peers
        )
        router_pb2_grpc.add_ControlServicer_to_server(control, host.server)
        self.discovery = None
        if config.discovery == "dns":
            resolver = DnsResolver(config.discovery_dns_server)
            self.discovery = Discovery(config.workers, resolver, self._found, self._let_go, what="worker")

    def _transports(self, config: RouterConfig) -> WorkerTransports:
        """The road to each worker, with the link's counters and, when the Worker RPCs are traced, its spans."""
        worker_spans = self.tracing.on and rpc_spans_for(worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name)
        return WorkerTransports(
            self.links,
            batched=config.worker_link == "auto",
            tracer=self.tracing.tracer if worker_spans else None,  # a span per link stream, as per Generate call
            counters=self.metrics.link_counters,
        )

    def _quotas(self, config: RouterConfig) -> Quotas:
        """The tenants' quotas, their refusals and Redis's state in the metrics."""
        quotas = Quotas(config.quota_file, config.quota_window_s, config.quota_redis_url, processes=config.processes)
        quotas.on_refusal = self.metrics.quota_refused
        if quotas.shared is not None:
            self.metrics.watch_shared_quotas(lambda: quotas.shared_up)
        return quotas

    def _link_mode(self, address: str) -> str:
        """How generations reach the worker (RoutingEntry.link)."""
        return self.transports.mode(address)

    def _watch(self, address: str, found_by: str = "static") -> None:
        self.pool.add(address, found_by)  # one discovery had let go is taken back
        if address not in self.links:
            link = self.links.open(address)
            link.run("health watch", self._watch_worker)
            self.transports.watch(link, LINK_CHANNEL_OPTIONS)

    def _found(self, address: str, name: str) -> None:
        self._watch(address, f"dns {name}")

    def _let_go(self, address: str, why: str) -> None:
        """Discovery lost the worker: drain it from routing; drop it once its streams ended."""
        entry = self.pool.entries.get(address)
        if entry is not None:
            self.pool.let_go(entry, why)
            self._drop_idle()

    def _drop_idle(self) -> None:
        """Forget every worker discovery let go that has no stream left here."""
        for entry in [e for e in self.pool.entries.values() if e.gone and e.in_flight == 0]:
            log.info("worker %s dropped (%s; no stream left)", entry.address, entry.gone)
            self.pool.drop(entry)
            self.links.drop(entry.address)  # its watch and spare end, its channels close

    async def _watch_worker(self, link: Link) -> None:
        """Keep the pool's view of the worker's health and models current from health Watch and Describe."""
        entry = self.pool.entries[link.address]
        stub = link.stub(worker_pb2_grpc.WorkerStub)
        health = link.stub(health_pb2_grpc.HealthStub)
        reconnect = Reconnect("health watch", link.address, logger=log)

        async def session() -> None:
            refresh = asyncio.create_task(self._refresh_models(stub, entry))
            try:
                async for update in health.Watch(health_pb2.HealthCheckRequest(service="")):
                    reconnect.connected()
                    serving = update.status == health_pb2.HealthCheckResponse.SERVING
                    described = None
                    if serving:
                        # A worker that does not answer in time is tried again (TimeoutError is transient).
                        described = await asyncio.wait_for(stub.Describe(worker_pb2.DescribeRequest()), 5)
                    self.pool.set_health(
                        entry, serving, "health SERVING" if serving else "health NOT_SERVING", described
                    )
                raise StreamEnded("health stream ended")
            except (grpc.aio.AioRpcError, ConnectionError, TimeoutError) as exc:
                self.pool.set_health(entry, False, f"unreachable: {failure_name(exc)}")
                self.transports.lost(link.address)  # restarted, perhaps upgraded: Link is asked again
                raise
            finally:
                refresh.cancel()

        await reconnect.run(session)

    async def _refresh_models(self, stub: worker_pb2_grpc.WorkerStub, entry: WorkerEntry) -> None:
        """Read again the Describe of a serving worker with LoRA adapters: which it has loaded changes with loads.

        A poll (every MODELS_REFRESH_S): a worker has no call that pushes its models; one Describe a second per
        such worker is small beside its generations. A failed read is left to the health watch.
        """
        while True:
            await asyncio.sleep(MODELS_REFRESH_S)
            if not entry.healthy or not any(m.base for m in entry.models.values()):
                continue
            try:
                described = await asyncio.wait_for(stub.Describe(worker_pb2.DescribeRequest()), 5)
            except (grpc.aio.AioRpcError, TimeoutError) as exc:
                log.debug("Describe of %s failed: %s", entry.address, failure_name(exc))
                continue
            self.pool.set_models(entry, described)

    async def _add_workers(self) -> None:
        while True:
            self._watch(await self._new_workers.get(), "prober")

    async def _start(self) -> None:
        """Start watching the configured (or the first discovered) workers, then SERVING."""
        if self.discovery is not None:
            await self.discovery.refresh()  # names that do not resolve yet are retried, never fatal
            self.spawn(self.discovery.run(self.config.discovery_interval_s, then=self._drop_idle), "DNS discovery")
        else:
            for address in self.config.workers:
                self._watch(address)
        self.spawn(self._add_workers(), "worker discovery")
        if self.quotas.shared is not None:
            await self.quotas.check_shared()  # how many routers share Redis (or that it is down: never fatal)
        if self.config.quota_file or self.quotas.shared is not None:
            self.spawn(self.quotas.run(), "quotas")
        if self.tls.on:
            renewed = [self.links] if self.peers is None else [self.links, self.peers.links]
            self.spawn(follow_renewals(self.tls.renewals(), *renewed), "certificate renewals")
        if self.peers is not None:
            self.peers.register(self.host.private_address)
            if self.config.process_index == 0:
                await self._start_siblings()
        if self.config.metrics_port:  # each process of a --processes router on its own port, one after the other
            self.metrics_endpoint = MetricsEndpoint(
                self.metrics.registry, self.config.host, self.config.metrics_port + self.config.process_index, "router"
            )
        await self.host.set_ready(True)
        log.info(
            "router%s SERVING on %s with workers %s",
            f" process {self.config.process_index + 1}/{self.config.processes}" if self.peers else "",
            self.host.address,
            ", ".join(self.config.workers) or "-",
        )
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
            self._siblings.append(
                subprocess.Popen(  # noqa: S603 - our own interpreter and module
                    dies_with_parent([sys.executable, "-m", "tokenmesh", "router"]), env=env, stdin=subprocess.DEVNULL
                )
            )
        try:
            await self.peers.wait_listed(60)
        except TimeoutError as exc:
            raise RuntimeError(f"router processes did not start: {exc}") from None

    async def _drain(self) -> None:
        """Refuse new generations; let in-flight ones finish within the grace period."""
        for sibling in self._siblings:
            sibling.terminate()  # each drains its own in-flight generations
        if self.peers is not None:
            self.peers.unregister()
            await self.peers.close()
        self.inference.drain()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.inference.live.idle.wait(), self.drain_grace_s)

    async def _close(self) -> None:
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.close()
        await asyncio.to_thread(self.tracing.shutdown)  # exports what is pending (blocking I/O)
        self.inference.cancels.close()
        await self.quotas.close()
        await self.links.close()  # the spares, the watches, every channel (retired ones too)
        for sibling in self._siblings:
            await asyncio.to_thread(stop_process, sibling, 10.0)
        if self._own_peers_dir is not None:
            self._own_peers_dir.cleanup()
