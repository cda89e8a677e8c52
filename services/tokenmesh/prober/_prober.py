"""The prober: watches every worker, computes routing weights, pushes them to routers.

Per worker it keeps a health ``Watch`` stream and a ``Stats`` stream on which it
pings every ``interval_s`` (the answer's round trip is the probe RTT). The
weights are recomputed at every ping round and at once on any health change;
a table that differs from the last one gets a new version and is pushed to
every router over ``Control.PushWeights``, whose acks are recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenmesh.discovery import Discovery, DnsResolver
from tokenmesh.lifecycle import Service
from tokenmesh.links import Link, Links, follow_renewals
from tokenmesh.metrics import MetricsEndpoint
from tokenmesh.prober._config import ProberConfig
from tokenmesh.prober._metrics import ProberMetrics
from tokenmesh.prober._weights import Scoring, WorkerView, compute_weight, nonsense
from tokenmesh.retry import Reconnect, StreamEnded, failure_name, write
from tokenmesh.server import CHANNEL_OPTIONS, ServiceHost, write_ready_file
from tokenmesh.tls import Tls
from tokenmesh.tracing import Tracing
from tokenmesh.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class _RouterLink:
    address: str
    acked_version: int = 0
    connected: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class Prober(Service):
    """Lifecycle of the prober: start, run, shutdown (idempotent).

    Every loop (health watch and stats per worker, weight push per router)
    reconnects under :mod:`tokenmesh.retry`: a permanent status (e.g. an
    address that answers UNIMPLEMENTED: it is not a tokenmesh worker or
    router) stops the prober with a non-zero exit instead of retrying for ever.

    Args:
        config: the prober's settings.

    """

    config: ProberConfig
    views: dict[str, WorkerView]
    routers: dict[str, _RouterLink]
    table: router_pb2.WeightTable
    """The table decided last (version 0: none yet)."""
    scoring: Scoring
    metrics: ProberMetrics
    tls: Tls
    tracing: Tracing
    """RPC spans of its probes and its weight pushes, and of the calls it serves (OTEL_* variables; off by default)."""
    metrics_endpoint: MetricsEndpoint | None
    _next_version: int
    _changed: asyncio.Event
    worker_links: Links
    """Per worker: its channel, health watch and stats stream."""
    router_links: Links
    """Per router: its channel and weight push."""
    _discoveries: list[Discovery]
    """The names' lookups (--discovery dns): workers, then routers."""

    def __init__(self, config: ProberConfig) -> None:
        self.tracing = Tracing("prober")
        self.tls = Tls(config, tracing=self.tracing)
        host = ServiceHost(
            config.host, config.port, [], health_port=config.health_port, tls=self.tls, tracing=self.tracing
        )
        super().__init__(host, drain_grace_s=0, stop_grace_s=config.stop_grace_s)
        self.config = config
        self.views = {}
        self.routers = {}
        self.table = router_pb2.WeightTable()
        self.scoring = Scoring(
            stale_after_s=max(config.probe_timeout_s, 3 * config.interval_s),
            memory_threshold=config.memory_threshold,
            ttft_slo_ms=config.ttft_slo_ms,
        )
        self.metrics = ProberMetrics()
        self.metrics.watch(lambda: self.table, self.views, self.routers)
        self.metrics_endpoint = None
        self._next_version = int(time.time() * 1000)  # grows across prober restarts
        self._changed = asyncio.Event()
        # Every call on a link is one of its tasks, started again on the new channel at a renewal:
        # the old channel carries nothing and is closed at once.
        self.worker_links = Links(self.tls.channel, CHANNEL_OPTIONS, spawn=self.spawn, keep_retired=False)
        self.router_links = Links(self.tls.channel, CHANNEL_OPTIONS, spawn=self.spawn, keep_retired=False)
        self._discoveries = []
        if config.discovery == "dns":
            resolver = DnsResolver(config.discovery_dns_server)
            self._discoveries = [
                Discovery(
                    config.workers, resolver, self._add_worker, lambda a, _: self._remove("worker", a), what="worker"
                ),
                Discovery(
                    config.routers, resolver, self._add_router, lambda a, _: self._remove("router", a), what="router"
                ),
            ]

    # -- watching workers ---------------------------------------------------

    def _mark(self, view: WorkerView, *, reachable: bool, serving: bool | None = None, error: str = "") -> None:
        changed = view.reachable != reachable or (serving is not None and view.serving != serving)
        view.probed = True
        view.reachable = reachable
        if serving is not None:
            view.serving = serving
        if error:
            view.error = error
        if changed:
            self._changed.set()

    async def _watch_health(self, link: Link) -> None:
        view = self.views[link.address]
        stub = link.stub(health_pb2_grpc.HealthStub)
        reconnect = Reconnect("health watch", view.address, logger=log)

        async def session() -> None:
            try:
                async for update in stub.Watch(health_pb2.HealthCheckRequest(service="")):
                    reconnect.connected()
                    self._mark(view, reachable=True, serving=update.status == health_pb2.HealthCheckResponse.SERVING)
                raise StreamEnded("health stream ended")
            except (grpc.aio.AioRpcError, StreamEnded) as exc:
                self._mark(view, reachable=False, serving=False, error=f"health {failure_name(exc)}")
                raise

        await reconnect.run(session)

    async def _watch_stats(self, link: Link) -> None:
        view = self.views[link.address]
        stub = link.stub(worker_pb2_grpc.WorkerStub)
        timeout = self.config.probe_timeout_s
        reconnect = Reconnect("stats stream", view.address, logger=log)
        ping_id = 0

        async def session() -> None:
            nonlocal ping_id
            call = stub.Stats()
            try:
                while True:
                    ping_id += 1
                    sent = time.monotonic()
                    await asyncio.wait_for(write(call, worker_pb2.StatsPing(ping_id=ping_id)), timeout)
                    stats = await asyncio.wait_for(call.read(), timeout)
                    if stats is grpc.aio.EOF:
                        raise StreamEnded("stats stream ended")
                    reconnect.connected()
                    self._take(view, stats, time.monotonic() - sent)
                    await asyncio.sleep(self.config.interval_s)
            except (grpc.aio.AioRpcError, TimeoutError, ConnectionError) as exc:
                self._mark(view, reachable=False, error=f"stats {failure_name(exc)}")
                raise
            finally:
                call.cancel()

        await reconnect.run(session)

    def _take(self, view: WorkerView, stats: worker_pb2.WorkerStats, rtt_s: float) -> None:
        """Record one stats answer (unless it cannot be true)."""
        view.rtt_s = rtt_s
        problem = nonsense(stats)
        if problem:
            if problem != view.error:
                log.warning("worker %s reports nonsense (%s); treating its stats as stale", view.address, problem)
            view.error = problem
            return  # stats_at is not advanced: the weight falls to the stale floor
        if view.stats is not None and stats.oom_total > view.stats.oom_total:
            view.oom_at = time.monotonic()
        view.stats = stats
        view.stats_at = time.monotonic()
        # A worker that was stopped (SIGSTOP) keeps its health stream
        # open; an answered ping is what says it is back.
        self._mark(view, reachable=True)

    # -- weights ------------------------------------------------------------

    def compute_table(self) -> list[router_pb2.WorkerWeight]:
        """Weights of every worker right now."""
        now = time.monotonic()
        result = []
        for address in sorted(self.views):
            view = self.views[address]
            w = compute_weight(view, now, self.scoring)
            stats = view.stats
            result.append(
                router_pb2.WorkerWeight(
                    address=address,
                    weight=w.weight,
                    state=w.state,
                    reason=w.reason,
                    triton_url=stats.triton_url if stats else "",
                    # A limit measured while the worker was not serving (no model loaded yet: 1) would hold a
                    # worker that just became SERVING at one generation until its next stats; 0 = the router keeps
                    # its own (the worker's Describe when it became SERVING).
                    concurrency_limit=stats.concurrency_limit if stats and stats.serving else 0,
                )
            )
        return result

    def _nothing_known_yet(self) -> bool:
        """Just started: no worker answered or failed a probe yet, and none for as long as a probe may take.

        A table now would call every worker unreachable, which the routers read as this prober cut off from them
        (they route on their own health view, and say so in a warning): nothing worth sending.
        """
        now = time.monotonic()
        return bool(self.views) and all(
            not v.probed and now - v.since < self.config.probe_timeout_s for v in self.views.values()
        )

    async def _recompute(self) -> None:
        """Decide a new table at every ping round and at once on any change; wake the pushers."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self.config.interval_s)
            self._changed.clear()
            if self._nothing_known_yet():
                continue
            workers = self.compute_table()
            if list(self.table.workers) == workers:
                continue
            self._next_version += 1
            table = router_pb2.WeightTable(version=self._next_version, workers=workers)
            table.decided_at.GetCurrentTime()
            self.table = table
            self.metrics.tables.inc()
            log.debug(
                "weights v%d: %s",
                table.version,
                ", ".join(f"{w.address}={w.weight:.2f}" for w in workers),
            )
            for link in self.routers.values():
                link.wake.set()

    # -- pushing to routers -------------------------------------------------

    async def _push(self, router: Link) -> None:
        link = self.routers[router.address]
        stub = router.stub(router_pb2_grpc.ControlStub)
        reconnect = Reconnect("weight push", link.address, logger=log)

        async def session() -> None:
            call = stub.PushWeights()
            reader = asyncio.create_task(self._read_acks(link, call, reconnect))
            try:
                sent = 0
                while True:
                    # Cleared before the table is read: a table decided while the write
                    # below is in flight sets it again, and the wait returns at once.
                    link.wake.clear()
                    if self.table.version and self.table.version != sent:
                        sent = self.table.version
                        await write(call, self.table)
                    waiter = asyncio.create_task(link.wake.wait())
                    done, _ = await asyncio.wait({waiter, reader}, return_when=asyncio.FIRST_COMPLETED)
                    if reader in done:
                        waiter.cancel()
                        reader.result()  # raises the stream's error
                        raise StreamEnded("ack stream ended")
            except (grpc.aio.AioRpcError, ConnectionError, grpc.aio.UsageError):
                link.connected = False
                raise
            finally:
                reader.cancel()
                call.cancel()

        await reconnect.run(session)

    async def _read_acks(
        self, link: _RouterLink, call: grpc.aio.StreamStreamCall[Any, Any], reconnect: Reconnect
    ) -> None:
        async for ack in call:
            reconnect.connected()
            link.connected = True
            link.acked_version = max(link.acked_version, ack.version)

    # -- lifecycle ------------------------------------------------------------

    def _add_worker(self, address: str, found_by: str = "") -> None:
        if address in self.views:
            return
        self.views[address] = WorkerView(address)
        link = self.worker_links.open(address)
        link.run("health watch", self._watch_health)
        link.run("stats", self._watch_stats)
        self._changed.set()

    def _add_router(self, address: str, found_by: str = "") -> None:
        if address in self.routers:
            return
        self.routers[address] = _RouterLink(address)
        self.router_links.open(address).run("weight push", self._push)

    def _remove(self, kind: str, address: str) -> None:
        """Discovery lost a worker or router: stop watching it (a worker leaves the next table)."""
        (self.views if kind == "worker" else self.routers).pop(address, None)
        (self.worker_links if kind == "worker" else self.router_links).drop(address)
        self._changed.set()

    async def _start(self) -> None:
        """Start watching and pushing; ready once the loops run."""
        if self.config.metrics_port:
            self.metrics_endpoint = MetricsEndpoint(
                self.metrics.registry, self.config.host, self.config.metrics_port, "prober"
            )
        if self._discoveries:
            # Names that do not resolve yet are retried every interval, never fatal.
            await asyncio.gather(*(d.refresh() for d in self._discoveries))
            for what, discovery in zip(("workers", "routers"), self._discoveries, strict=True):
                self.spawn(discovery.run(self.config.discovery_interval_s), f"DNS discovery of {what}")
        else:
            for address in self.config.workers:
                self._add_worker(address)
            for address in self.config.routers:
                self._add_router(address)
        self.spawn(self._recompute(), "recompute")
        if self.tls.on:
            # Each view keeps what it knows meanwhile: no table loses a worker while its loops start again.
            self.spawn(
                follow_renewals(self.tls.renewals(), self.worker_links, self.router_links), "certificate renewals"
            )
        await self.host.set_ready(True)
        log.info(
            "prober on %s watching %d workers, pushing to %d routers",
            self.host.address,
            len(self.views),
            len(self.routers),
        )
        write_ready_file(self.config.ready_file, address=self.host.address, pid=os.getpid())

    async def _close(self) -> None:
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.close()
        await self.worker_links.close()
        await self.router_links.close()
        await asyncio.to_thread(self.tracing.shutdown)  # exports what is pending (blocking I/O)
