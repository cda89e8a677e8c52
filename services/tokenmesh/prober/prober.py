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

from tokenmesh.config import check, csv, setting
from tokenmesh.lifecycle import Service
from tokenmesh.retry import Reconnect, StreamEnded
from tokenmesh.server import CHANNEL_OPTIONS, ServiceHost, write_ready_file
from tokenmesh.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

MIN_WEIGHT = 0.05
"""Weight of a serving worker with no free slot (or stale stats): still picked, rarely."""
OOM_PENALTY_S = 30.0
"""For this long after a worker reports a device OOM its weight is halved."""


@dataclass(frozen=True, kw_only=True)
class ProberConfig:
    """Settings of the prober (flags ``--name``, env ``TOKENMESH_PROBER_NAME``)."""

    host: str = setting("127.0.0.1", "address to listen on (health and reflection only)")
    port: int = setting(50071, "gRPC port; 0 picks a free one")
    workers: tuple[str, ...] = setting((), "worker addresses host:port, comma-separated", parse=csv)
    routers: tuple[str, ...] = setting((), "router addresses host:port to push weights to, comma-separated", parse=csv)
    interval_s: float = setting(0.1, "seconds between stats pings to each worker (and weight recomputations)")
    probe_timeout_s: float = setting(1.0, "a ping unanswered this long marks the worker unreachable")
    memory_threshold: float = setting(0.92, "device memory used/total above which a worker's weight falls")
    ttft_slo_ms: float = setting(2000.0, "TTFT objective: a worker averaging more gets weight x slo/ttft")
    stop_grace_s: float = setting(0.5, "on SIGTERM, how long open calls to the prober (health watches) may take")
    ready_file: str = setting("", "write {address, pid} as JSON here once running")

    def __post_init__(self) -> None:
        """Validate ranges."""
        check(0 <= self.port <= 65535, f"port must be 0..65535, got {self.port}")
        check(bool(self.workers), "give at least one worker address (--workers host:port,...)")
        check(0 < self.interval_s <= 10, f"interval_s must be in (0, 10], got {self.interval_s}")
        check(self.probe_timeout_s > 0, f"probe_timeout_s must be > 0, got {self.probe_timeout_s}")
        check(0 < self.memory_threshold < 1, f"memory_threshold must be in (0, 1), got {self.memory_threshold}")
        check(self.ttft_slo_ms > 0, f"ttft_slo_ms must be > 0, got {self.ttft_slo_ms}")
        check(self.stop_grace_s >= 0, f"stop_grace_s must be >= 0, got {self.stop_grace_s}")
        for address in (*self.workers, *self.routers):
            check(":" in address, f"address {address!r} must be host:port")


@dataclass
class WorkerView:
    """What the prober currently knows of one worker."""

    address: str
    reachable: bool = False
    serving: bool = False
    stats: worker_pb2.WorkerStats | None = None
    stats_at: float = 0.0
    rtt_s: float | None = None
    error: str = "not contacted yet"
    oom_at: float = -1e9
    """When the worker's oom_total last rose (time.monotonic())."""


@dataclass(frozen=True)
class Weight:
    """A worker's weight and why."""

    weight: float
    state: router_pb2.WorkerState
    reason: str


def nonsense(stats: worker_pb2.WorkerStats) -> str:
    """Why these stats cannot be true ('' when they can): such a worker is treated as stale."""
    if stats.concurrency_limit == 0:
        return "concurrency_limit 0"
    if stats.in_flight > 1_000_000:
        return f"in_flight {stats.in_flight}"
    for d in stats.devices:
        if d.HasField("memory_total_bytes") and d.memory_used_bytes > d.memory_total_bytes:
            return f"device {d.index} memory used {d.memory_used_bytes} > total {d.memory_total_bytes}"
        if d.HasField("utilization_percent") and d.utilization_percent > 100:
            return f"device {d.index} utilization {d.utilization_percent}%"
    return ""


@dataclass(frozen=True)
class Scoring:
    """Knobs of the weight function (see :func:`compute_weight`)."""

    stale_after_s: float = 1.0
    """Stats older than this count as saturated."""
    memory_threshold: float = 0.92
    """Device memory used/total above this lowers the weight, to 0 at 100%."""
    ttft_slo_ms: float = 2000.0
    """A TTFT average above this scales the weight by slo / ttft."""
    oom_penalty_s: float = OOM_PENALTY_S
    """For this long after a device OOM the weight is halved."""


def compute_weight(view: WorkerView, now: float, scoring: Scoring) -> Weight:
    """Weight of one worker in [0, 1].

    0 unless reachable and SERVING. Otherwise the free fraction of its slots
    (limit - in_flight) / limit, then: x 1/(1 + pending) while Triton's own
    scheduler queue holds requests; x slo/ttft when its TTFT average is over
    the SLO; x (1 - used) / (1 - threshold) for the fullest device over the
    memory threshold; x 0.5 within oom_penalty_s of a device OOM. Stale stats
    count as saturated. A serving worker never drops below MIN_WEIGHT, so it
    still gets work when every worker is busy.
    """
    if not view.reachable:
        return Weight(0.0, router_pb2.WORKER_STATE_UNREACHABLE, f"unreachable: {view.error}")
    if not view.serving:
        why = view.stats.state_reason if view.stats is not None and view.stats.state_reason else ""
        return Weight(0.0, router_pb2.WORKER_STATE_NOT_SERVING, f"health NOT_SERVING: {why or 'starting'}")
    stats = view.stats
    if stats is None or now - view.stats_at > scoring.stale_after_s:
        return Weight(MIN_WEIGHT, router_pb2.WORKER_STATE_SERVING, "serving, stats stale")
    limit = max(stats.concurrency_limit, 1)
    free = max(limit - stats.in_flight, 0)
    weight = free / limit
    reasons = [f"serving, {free}/{limit} slots free"]
    if stats.triton_pending:
        weight /= 1 + stats.triton_pending
        reasons.append(f"{stats.triton_pending} waiting in Triton's queue")
    if stats.HasField("ttft_ms") and stats.ttft_ms > scoring.ttft_slo_ms:
        weight *= scoring.ttft_slo_ms / stats.ttft_ms
        reasons.append(f"TTFT {stats.ttft_ms:.0f} ms > SLO {scoring.ttft_slo_ms:.0f} ms")
    for device in stats.devices:
        if device.HasField("memory_used_bytes") and device.memory_total_bytes:
            used = device.memory_used_bytes / device.memory_total_bytes
            if used > scoring.memory_threshold:
                weight *= max(0.0, (1 - used) / (1 - scoring.memory_threshold))
                reasons.append(f"device {device.index} memory {used:.0%} > {scoring.memory_threshold:.0%}")
    since_oom = now - view.oom_at
    if since_oom < scoring.oom_penalty_s:
        weight /= 2
        reasons.append(f"device out of memory {since_oom:.0f} s ago")
    return Weight(max(round(weight, 2), MIN_WEIGHT), router_pb2.WORKER_STATE_SERVING, ", ".join(reasons))


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
    _next_version: int
    _changed: asyncio.Event
    _channels: list[grpc.aio.Channel]

    def __init__(self, config: ProberConfig) -> None:
        super().__init__(ServiceHost(config.host, config.port, []), drain_grace_s=0, stop_grace_s=config.stop_grace_s)
        self.config = config
        self.views = {a: WorkerView(a) for a in config.workers}
        self.routers = {a: _RouterLink(a) for a in config.routers}
        self.table = router_pb2.WeightTable()
        self.scoring = Scoring(
            stale_after_s=max(config.probe_timeout_s, 3 * config.interval_s),
            memory_threshold=config.memory_threshold,
            ttft_slo_ms=config.ttft_slo_ms,
        )
        self._next_version = int(time.time() * 1000)  # grows across prober restarts
        self._changed = asyncio.Event()
        self._channels = []

    # -- watching workers ---------------------------------------------------

    def _mark(self, view: WorkerView, *, reachable: bool, serving: bool | None = None, error: str = "") -> None:
        changed = view.reachable != reachable or (serving is not None and view.serving != serving)
        view.reachable = reachable
        if serving is not None:
            view.serving = serving
        if error:
            view.error = error
        if changed:
            self._changed.set()

    async def _watch_health(self, view: WorkerView, channel: grpc.aio.Channel) -> None:
        stub = health_pb2_grpc.HealthStub(channel)
        reconnect = Reconnect("health watch", view.address, logger=log)

        async def session() -> None:
            try:
                async for update in stub.Watch(health_pb2.HealthCheckRequest(service="")):
                    reconnect.connected()
                    self._mark(view, reachable=True, serving=update.status == health_pb2.HealthCheckResponse.SERVING)
                raise StreamEnded("health stream ended")
            except (grpc.aio.AioRpcError, StreamEnded) as exc:
                self._mark(view, reachable=False, serving=False, error=f"health {_reason(exc)}")
                raise

        await reconnect.run(session)

    async def _watch_stats(self, view: WorkerView, channel: grpc.aio.Channel) -> None:
        stub = worker_pb2_grpc.WorkerStub(channel)
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
                    await asyncio.wait_for(call.write(worker_pb2.StatsPing(ping_id=ping_id)), timeout)
                    stats = await asyncio.wait_for(call.read(), timeout)
                    if stats is grpc.aio.EOF:
                        raise StreamEnded("stats stream ended")
                    reconnect.connected()
                    self._take(view, stats, time.monotonic() - sent)
                    await asyncio.sleep(self.config.interval_s)
            except (grpc.aio.AioRpcError, TimeoutError, ConnectionError) as exc:
                self._mark(view, reachable=False, error=f"stats {_reason(exc)}")
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
                    concurrency_limit=stats.concurrency_limit if stats else 0,
                )
            )
        return result

    async def _recompute(self) -> None:
        """Decide a new table at every ping round and at once on any change; wake the pushers."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self.config.interval_s)
            self._changed.clear()
            workers = self.compute_table()
            if list(self.table.workers) == workers:
                continue
            self._next_version += 1
            table = router_pb2.WeightTable(version=self._next_version, workers=workers)
            table.decided_at.GetCurrentTime()
            self.table = table
            log.debug(
                "weights v%d: %s",
                table.version,
                ", ".join(f"{w.address}={w.weight:.2f}" for w in workers),
            )
            for link in self.routers.values():
                link.wake.set()

    # -- pushing to routers -------------------------------------------------

    async def _push(self, link: _RouterLink, channel: grpc.aio.Channel) -> None:
        stub = router_pb2_grpc.ControlStub(channel)
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
                        await call.write(self.table)
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

    async def _start(self) -> None:
        """Start watching and pushing; ready once the loops run."""
        for address, view in self.views.items():
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels.append(channel)
            self.spawn(self._watch_health(view, channel), f"health watch {address}")
            self.spawn(self._watch_stats(view, channel), f"stats {address}")
        for address, link in self.routers.items():
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels.append(channel)
            self.spawn(self._push(link, channel), f"weight push {address}")
        self.spawn(self._recompute(), "recompute")
        await self.host.set_ready(True)
        log.info("prober on %s watching %d workers, pushing to %d routers", self.host.address,
                 len(self.views), len(self.routers))
        write_ready_file(self.config.ready_file, address=self.host.address, pid=os.getpid())

    async def _close(self) -> None:
        for channel in self._channels:
            await channel.close()


def _reason(exc: BaseException) -> str:
    return exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__
