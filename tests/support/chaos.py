"""Fault rows on a :class:`~tests.support.cluster.Cluster`: callers through ``tokenmesh.client`` while one
fault hits the cluster, and what they saw.

In a fault row (:func:`fault_row`) each caller runs generations back to back (so some arrive during the fault);
the row waits until every generation streams, injects its fault, waits until the routers route to the victim
again, then lets each caller finish its generation. A generation is **broken** when it was admitted (it got a
chunk) and then ended in an error, skipped or repeated a ``seq``, or ended with other than the tokens asked for.
**Time to detect**: from the fault until every router stops routing new work to the victim (its table row is
not SERVING, has weight 0, or says the router avoids it); none (``-``) where the mesh should go on as before.
**Failover gap**: per generation that moved to another worker (its final chunk's ``migrations``), the longest
wait for a chunk (the first one included) after the fault. **Time to recover**: from the heal (or the restart)
until every router routes to the victim again. **Left**: processes left in the pods that belong to no running
service, and iptables rules left in the pods.

The faults: a worker SIGKILLed and started again (once: :func:`kill_and_restart`; every 10 s:
:func:`churn_row`), a silent partition between the routers and a worker, the DNS server stopped, the prober cut
from the workers or from the routers, packet loss on a worker's pod, added latency between the routers and a
worker (:func:`delay_row`), a rolling restart of every tier (:func:`rolling_row`) and overload
(:func:`overload_row`). ``tests/cluster`` runs each short; ``benchmarks/chaos.py`` at full size.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from tests.support.callers import Callers, Trace, call, request
from tests.support.cluster import Cluster, Service, routable
from tests.support.tcp_proxy import DelayProxy
from tokenmesh.bench.metrics import percentile
from tokenmesh.client import Client
from tokenmesh.v1 import router_pb2, router_pb2_grpc

POLL_S = 0.05
"""How often the routers' tables are read while a fault lasts."""
BLIND = "the prober reaches no worker"
"""How a router's table reason begins while it routes on its own health view (router/_pool.py)."""


@dataclass
class Row:
    """One row of the chaos table."""

    name: str
    offered: int
    admitted: int = 0
    refused: int = 0
    refused_without_hint: int = 0
    broken: int = 0
    moved: int = 0
    """Generations that moved to another worker."""
    fault_at: float = 0.0
    """time.monotonic() when the fault began (the fault rows)."""
    heal_at: float = 0.0
    """time.monotonic() when it was healed."""
    detect_s: float | None = None
    gap_p50_s: float | None = None
    gap_p99_s: float | None = None
    recover_s: float | None = None
    strays: list[int] = field(default_factory=list)
    rules: list[str] = field(default_factory=list)
    """iptables rules left in the pods after the row."""
    others_lost: list[str] = field(default_factory=list)
    """Workers other than the victim that some router stopped routing to during the row."""
    ended: dict[str, int] = field(default_factory=dict)
    """Worker name -> generations that ended on it while the fault lasted."""
    via_gateway: int = 0
    """Generations through the gateway's SSE (the rest through ``tokenmesh.client``)."""
    streaming_at_faults: list[int] = field(default_factory=list)
    """Generations streaming at each fault (the churn row: at each kill)."""
    victim_served: int | None = None
    """Generations that ended on the victim during the row (the latency row)."""
    note: str = ""
    problems: list[str] = field(default_factory=list)
    """The first broken streams, described."""
    traces: list[Trace] = field(default_factory=list, repr=False)
    """Every generation of the row."""

    HEADER = (
        f"{'row':<26} {'offered':>7} {'admitted':>8} {'refused':>7} {'no hint':>7} {'broken':>6} {'moved':>5} "
        f"{'detect s':>8} {'gap p50':>7} {'gap p99':>7} {'recover s':>9} {'left':>4}  note"
    )

    def line(self) -> str:
        """The row, under HEADER (left: stray processes and iptables rules)."""
        return (
            f"{self.name:<26} {self.offered:>7} {self.admitted:>8} {self.refused:>7} {self.refused_without_hint:>7} "
            f"{self.broken:>6} {self.moved:>5} {_s(self.detect_s):>8} {_s(self.gap_p50_s):>7} "
            f"{_s(self.gap_p99_s):>7} {_s(self.recover_s):>9} {len(self.strays) + len(self.rules):>4}  "
            + "; ".join(filter(None, [f"{self.via_gateway} via the gateway" if self.via_gateway else "", self.note]))
        )


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


class Watch:
    """Reads every router's table for one worker: when each stopped routing new work to it, and started again.

    Args:
        cluster: the cluster.
        victim: the worker watched (routable when the watch starts).

    """

    changes: dict[str, list[tuple[float, bool]]]
    """Router -> (time.monotonic(), routable now) at each change seen."""
    link_lost: dict[str, float]
    """Router -> when it was first seen without a Worker/Link call to the victim."""
    others_lost: set[str]
    """The other workers some router stopped routing to while watched."""
    served: dict[str, list[tuple[float, dict[str, int]]]]
    """Router -> (time.monotonic(), worker name -> its generations that ended there so far) at each read."""
    blind: dict[str, list[tuple[float, bool]]]
    """Router -> (time.monotonic(), on its own health view) at each change: its table said the prober reaches no
    worker (router/_pool.py)."""
    _victim: Service
    _names: dict[str, str]
    _channels: dict[str, grpc.aio.Channel]

    def __init__(self, cluster: Cluster, victim: Service) -> None:
        self.changes = {r.name: [] for r in cluster.routers}
        self.link_lost = {}
        self.others_lost = set()
        self.served = {r.name: [] for r in cluster.routers}
        self.blind = {r.name: [] for r in cluster.routers}
        self._victim = victim
        self._names = {w.address: w.name for w in cluster.workers}
        self._channels = {r.name: grpc.aio.insecure_channel(r.address) for r in cluster.routers}

    async def run(self) -> None:
        """Poll until cancelled; a router that does not answer in time is read again next round."""
        stubs = {name: router_pb2_grpc.RouterStub(channel) for name, channel in self._channels.items()}
        while True:
            for name, stub in stubs.items():
                try:
                    table = await stub.GetRoutingTable(router_pb2.GetRoutingTableRequest(), timeout=1)
                except grpc.aio.AioRpcError:
                    continue
                row = next((w for w in table.workers if w.address == self._victim.address), None)
                now = row is not None and routable(row)
                ended = {self._names.get(w.address, w.address): w.served_total for w in table.workers}
                self.served[name].append((time.monotonic(), ended))
                blind = any(w.reason.startswith(BLIND) for w in table.workers)
                if blind != (self.blind[name][-1][1] if self.blind[name] else False):
                    self.blind[name].append((time.monotonic(), blind))
                others = (w for w in table.workers if w.address != self._victim.address and not routable(w))
                self.others_lost.update(self._names.get(w.address, w.address) for w in others)
                if row is None or not row.link:
                    self.link_lost.setdefault(name, time.monotonic())
                if now != self.routable(name):
                    self.changes[name].append((time.monotonic(), now))
            await asyncio.sleep(POLL_S)

    def routable(self, router: str) -> bool:
        """Whether the router routes new work to the victim, as last seen."""
        changes = self.changes[router]
        return changes[-1][1] if changes else True

    def recovered(self) -> bool:
        """Every router routes new work to the victim."""
        return all(self.routable(name) for name in self.changes)

    def detected_s(self, fault_at: float) -> float | None:
        """From the fault until the last router stopped routing to the victim (None: one never did)."""
        firsts = [next((t for t, up in c if not up and t >= fault_at), None) for c in self.changes.values()]
        return None if None in firsts else max(t for t in firsts if t is not None) - fault_at

    def recovered_s(self, heal_at: float) -> float | None:
        """From the heal until the last router routed to the victim again, on the prober's tables (None: one does
        not)."""
        if not self.recovered() or self.on_own_view():
            return None
        changes = [*self.changes.values(), *self.blind.values()]
        return max([0.0, *(c[-1][0] - heal_at for c in changes if c)])

    def on_own_view(self) -> bool:
        """Some router routes on its own health view now (the prober reached no worker)."""
        return any(changes and changes[-1][1] for changes in self.blind.values())

    def own_view_spans(self, fault_at: float) -> str:
        """When the routers went to their own health view and back, in seconds after fault_at ('' if never)."""
        spans = [f"{t - fault_at:.1f}" + ("" if up else " back") for c in self.blind.values() for t, up in c]
        return f"routers on their own health view at {', '.join(spans)} s" if spans else ""

    def ended(self, since: float, until: float) -> dict[str, int]:
        """Worker name -> generations of the routers that ended on it between since and until (their tables'
        served_total)."""
        total: dict[str, int] = {}
        for reads in self.served.values():
            within = [ended for t, ended in reads if since <= t <= until]
            if within:
                for worker, count in within[-1].items():
                    total[worker] = total.get(worker, 0) + count - within[0].get(worker, count)
        return dict(sorted(total.items()))

    def back_during(self, fault_at: float, heal_at: float) -> int:
        """Times a router took the victim back while the fault lasted (it would send work where none gets)."""
        return sum(up for c in self.changes.values() for t, up in c if fault_at < t < heal_at)

    async def close(self) -> None:
        """Close the channels."""
        for channel in self._channels.values():
            await channel.close()


Fault = Callable[[Cluster, Service], Awaitable[tuple[float, float]]]
"""Injects a fault on the victim; returns (when it began, when it was healed), time.monotonic()."""


async def fault_row(
    cluster: Cluster,
    name: str,
    fault: Fault,
    *,
    streams: int,
    tokens: int,
    victim: int = 0,
    via_gateway: int = 0,
    recover_timeout_s: float = 120,
) -> Row:
    """``streams`` callers, each running generations of ``tokens`` tokens back to back (``via_gateway`` of them
    through the gateway's SSE), while ``fault`` hits worker ``victim``; the row ends once every router routes to
    it again (and each caller's last generation ended)."""
    watched = cluster.workers[victim]
    watch = Watch(cluster, watched)
    watching = asyncio.create_task(watch.run())
    try:
        async with Callers(cluster, name, streams=streams, tokens=tokens, via_gateway=via_gateway) as callers:
            await callers.streaming()
            fault_at, heal_at = await fault(cluster, watched)
            deadline = time.monotonic() + recover_timeout_s
            while (not watch.recovered() or watch.on_own_view()) and time.monotonic() < deadline:
                await asyncio.sleep(POLL_S)
            await callers.finish()
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        await watch.close()
    traces = callers.traces
    row = summarize(name, traces, tokens, fault_at)
    row.fault_at, row.heal_at = fault_at, heal_at
    row.detect_s = watch.detected_s(fault_at)
    row.recover_s = watch.recovered_s(heal_at)
    notes = []
    if back := watch.back_during(fault_at, heal_at):
        notes.append(f"routers took the victim back {back} time(s) while the fault lasted")
    if len(watch.link_lost) == len(watch.changes):  # when the link's keepalive gave up on a silent peer
        notes.append(f"links down after {max(watch.link_lost.values()) - fault_at:.1f} s")
    if late := sum(bool(t.migrations) and t.started > fault_at for t in traces):
        notes.append(f"{late} generation(s) that began after the fault moved")
    row.others_lost = sorted(watch.others_lost)
    if row.others_lost:
        notes.append(f"routers stopped routing to {', '.join(row.others_lost)} too")
    if spans := watch.own_view_spans(fault_at):
        notes.append(spans)
    row.ended = watch.ended(fault_at, heal_at)
    if row.ended:
        notes.append("generations ended during the fault: " + ", ".join(f"{w} {n}" for w, n in row.ended.items()))
    row.note = "; ".join(notes)
    row.strays = await strays(cluster)
    row.rules = await asyncio.to_thread(cluster.rules)
    return row


async def strays(cluster: Cluster, grace_s: float = 15) -> list[int]:
    """Processes in the pods that belong to no running service once grace_s passed (a killed worker's Triton
    stubs notice their parent is gone within a few seconds)."""
    deadline = time.monotonic() + grace_s
    while (found := cluster.strays()) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    return found


def summarize(name: str, traces: list[Trace], tokens: int, fault_at: float) -> Row:
    """Counts and failover gaps of a row's generations."""
    row = Row(name, len(traces), traces=traces, via_gateway=sum(t.via_gateway for t in traces))
    row.admitted = sum(t.admitted for t in traces)
    refused = [t for t in traces if not t.admitted and t.error]
    row.refused = len(refused)
    row.refused_without_hint = sum(not t.refused_with_hint for t in refused)
    broken = [t for t in traces if t.broken(tokens)]
    row.broken = len(broken)
    row.problems = [
        f"chunks {len(t.arrivals)} seq_ok {t.seq_ok} tokens {t.tokens}/{t.completion_tokens}/{tokens} "
        f"finish {t.finish} error {t.error!r}"
        for t in broken[:5]
    ]
    moved = [t for t in traces if t.migrations]
    row.moved = len(moved)
    gaps = sorted(max(t.gaps(after=fault_at, from_start=True), default=0.0) for t in moved)
    if gaps:
        row.gap_p50_s, row.gap_p99_s = percentile(gaps, 50), percentile(gaps, 99)
    return row


async def kill_and_restart(cluster: Cluster, victim: Service) -> tuple[float, float]:
    """SIGKILL the worker mid-stream, and start it again in its pod at once."""
    fault_at = time.monotonic()
    await asyncio.to_thread(cluster.kill, victim)
    restart_at = time.monotonic()
    cluster.spawn(victim)
    await asyncio.to_thread(cluster.wait_ready, [victim])
    return fault_at, restart_at


def lasting(
    seconds: float, inject: Callable[[Cluster, Service], None], heal: Callable[[Cluster, Service], None]
) -> Fault:
    """A fault that inject starts on the victim, lasting seconds, then undone by heal (also when cancelled)."""

    async def fault(cluster: Cluster, victim: Service) -> tuple[float, float]:
        await asyncio.to_thread(inject, cluster, victim)
        fault_at = time.monotonic()
        try:
            await asyncio.sleep(seconds)
        finally:
            await asyncio.to_thread(heal, cluster, victim)
        return fault_at, time.monotonic()

    return fault


def silent_partition(seconds: float) -> Fault:
    """Drop every packet between the worker and the routers, both ways (no RST), for seconds; then heal."""
    return lasting(
        seconds,
        lambda cluster, victim: cluster.partition(victim, cluster.routers),
        lambda cluster, victim: cluster.partition(victim, cluster.routers, heal=True),
    )


def dns_outage(seconds: float) -> Fault:
    """The DNS server stopped for seconds (every lookup of every pod fails), then started again with its records.

    Not aimed at the victim: it only names the worker the row watches.
    """
    return lasting(seconds, lambda cluster, _: cluster.stop_dns(), lambda cluster, _: cluster.start_dns())


def prober_cut(peers: str, seconds: float) -> Fault:
    """Every packet between the prober and the workers (peers "workers") or the routers ("routers") dropped both
    ways for seconds. Cut from the workers, the prober finds every worker unreachable while the routers reach
    them; cut from the routers, its tables stop arriving and the routers keep the last one and their own health
    view."""

    def others(cluster: Cluster) -> list[Service]:
        return cluster.workers if peers == "workers" else cluster.routers

    return lasting(
        seconds,
        lambda cluster, _: cluster.partition(cluster.prober, others(cluster)),
        lambda cluster, _: cluster.partition(cluster.prober, others(cluster), heal=True),
    )


def packet_loss(probability: float, seconds: float) -> Fault:
    """That fraction of the packets in and out of the victim's pod dropped at random for seconds (its links to the
    routers and to the prober alike)."""
    return lasting(
        seconds,
        lambda cluster, victim: cluster.lose(victim, probability),
        lambda cluster, victim: cluster.lose(victim, probability, heal=True),
    )


async def kill_watched(cluster: Cluster, victim: Service, wait_s: float) -> float | None:
    """SIGKILL the worker and start it again at once (not waiting for it); seconds until every router stopped
    routing to it (None: not within wait_s, or it was not routable before)."""
    watch = Watch(cluster, victim)
    watching = asyncio.create_task(watch.run())
    try:
        await asyncio.sleep(2 * POLL_S)  # a first read of every table
        fault_at = time.monotonic()
        await asyncio.to_thread(cluster.kill, victim)
        cluster.spawn(victim)
        while watch.detected_s(fault_at) is None and time.monotonic() < fault_at + wait_s:
            await asyncio.sleep(POLL_S)
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        await watch.close()
    return watch.detected_s(fault_at)


async def churn_row(cluster: Cluster, *, streams: int, tokens: int, kills: int, every_s: float = 10.0) -> Row:
    """``streams`` callers running generations back to back while a worker is SIGKILLed and started again every
    ``every_s``, each worker in turn, none waited for: the restarted worker comes back under a running prober
    and routers, the order in which a limit read before its model loaded held it at one slot. The note counts the
    generations streaming at each kill; time to detect is the slowest kill's, time to recover from the last
    restart until every router routes to every worker at its full slots."""
    at_kills: list[int] = []
    detected: list[float] = []
    async with Callers(cluster, "churn", streams=streams, tokens=tokens) as callers:
        await callers.streaming()
        began = time.monotonic()
        for kill in range(kills):
            await asyncio.sleep(max(0.0, began + kill * every_s - time.monotonic()))
            at_kills.append(callers.streaming_now())
            victim = cluster.workers[kill % len(cluster.workers)]
            if (seconds := await kill_watched(cluster, victim, every_s / 2)) is not None:
                detected.append(seconds)
        restarted_at = time.monotonic()
        await asyncio.to_thread(cluster.wait_ready, cluster.workers)
        await asyncio.to_thread(cluster.wait_routable)
        recovered_at = time.monotonic()
        await callers.finish()
    traces = callers.traces
    row = summarize(f"churn: SIGKILL every {every_s:g} s", traces, tokens, began)
    row.detect_s = max(detected, default=None)
    row.recover_s = recovered_at - restarted_at
    row.streaming_at_faults = at_kills
    row.note = (
        f"{kills} kills; generations streaming at each kill: {', '.join(map(str, at_kills))} of {streams}; "
        f"{len(detected)} kill(s) detected"
    )
    row.strays = await strays(cluster)
    row.rules = await asyncio.to_thread(cluster.rules)
    return row


async def delay_row(
    cluster: Cluster,
    *,
    delay_s: float,
    seconds: float,
    streams: int,
    tokens: int,
    victim: int = 0,
    via_gateway: int = 0,
) -> Row:
    """The routers reach worker ``victim`` through a :class:`~tests.support.tcp_proxy.DelayProxy` on the host
    (each router's connections to it DNATed there, the open ones reset before the callers start) that adds delay_s
    each way; callers run for seconds; then the routers reach it directly again (time to recover: from then until
    they route to it). The note: time to first chunk and inter-chunk gap p99, and the bytes proxied."""
    assert cluster.network is not None
    worker = cluster.workers[victim]
    host, port = worker.address.rsplit(":", 1)
    proxy = DelayProxy(host, int(port), host=cluster.network.gateway, delay_s=delay_s)
    await proxy.start()
    try:
        for router in cluster.routers:
            await asyncio.to_thread(cluster.redirect, router, worker, proxy.address)
            await asyncio.to_thread(cluster.reset, router, worker)
        deadline = time.monotonic() + 60
        while proxy.accepted < len(cluster.routers) and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        await asyncio.to_thread(cluster.wait_routable)
        served_before = await asyncio.to_thread(_served, cluster)
        hold = lasting(seconds, lambda *_: None, lambda *_: None)
        name = f"latency +{delay_s * 1000:.0f} ms each way"
        load = {"streams": streams, "tokens": tokens, "victim": victim, "via_gateway": via_gateway}
        row = await fault_row(cluster, name, hold, **load)
    finally:
        healed_at = time.monotonic()
        for router in cluster.routers:
            with contextlib.suppress(RuntimeError):  # a rule that was never added (the row failed before)
                await asyncio.to_thread(cluster.redirect, router, worker, proxy.address, undo=True)
        await proxy.stop()  # the proxied connections close: the routers connect directly again
    served = {a: n - served_before.get(a, 0) for a, n in (await asyncio.to_thread(_served, cluster)).items()}
    await asyncio.to_thread(cluster.wait_routable)
    row.recover_s = time.monotonic() - healed_at
    row.victim_served = served.get(worker.address, 0)
    first = sorted(t.arrivals[0] - t.started for t in row.traces if t.arrivals)
    gaps = sorted(g for t in row.traces for g in t.gaps())
    row.note = "; ".join(
        [
            f"{served.get(worker.address, 0)} of {sum(served.values())} generations ended on the delayed worker",
            f"{proxy.accepted} connection(s), {proxy.forwarded_bytes / 1e3:.0f} kB through the proxy",
            f"first chunk p50/p99 {percentile(first, 50):.2f}/{percentile(first, 99):.2f} s",
            f"chunk gap p99 {percentile(gaps, 99):.3f} s",
            *([row.note] if row.note else []),
        ]
    )
    row.rules = await asyncio.to_thread(cluster.rules)
    return row


def _served(cluster: Cluster) -> dict[str, int]:
    """Worker address -> generations of the routers that ended on it so far (their tables' served_total)."""
    served: dict[str, int] = {}
    for router in cluster.routers:
        for row in cluster.table(router).workers:
            served[row.address] = served.get(row.address, 0) + row.served_total
    return served


async def rolling_row(cluster: Cluster, *, streams: int, tokens: int, via_gateway: int = 0) -> Row:
    """``streams`` callers running generations back to back while every worker, then the prober, then (with two
    or more) every router, then (with callers through it) the gateway is restarted one at a time, as a
    Deployment's rollout does: SIGTERM (the service drains),
    started again once it exited, the next one once every router routes to every worker at its full slots. The
    note: each restart's drain + back-to-routable seconds; time to recover: the slowest back-to-routable."""
    restarts: list[str] = []
    back: list[float] = []
    rollout = [*cluster.workers, cluster.prober, *(cluster.routers if len(cluster.routers) > 1 else [])]
    if via_gateway:
        rollout.append(cluster.services["gateway"])
    async with Callers(cluster, "rolling", streams=streams, tokens=tokens, via_gateway=via_gateway) as callers:
        await callers.streaming()
        began = time.monotonic()
        for service in rollout:
            drained_s = await asyncio.to_thread(cluster.stop_draining, service)
            cluster.spawn(service)  # from the main thread, not to_thread's (see Cluster.spawn)
            spawned = time.monotonic()
            await asyncio.to_thread(cluster.wait_ready, [service])
            await asyncio.to_thread(cluster.wait_routable)
            back.append(time.monotonic() - spawned)
            restarts.append(f"{service.name} {drained_s:.1f}+{back[-1]:.1f}")
        await callers.finish()
    traces = callers.traces
    row = summarize("rolling restart", traces, tokens, began)
    row.recover_s = max(back)
    resumed = sum(t.resumed for t in traces)
    row.note = f"drain+back s: {', '.join(restarts)}" + (f"; SSE streams resumed {resumed} time(s)" if resumed else "")
    row.strays = await strays(cluster)
    row.rules = await asyncio.to_thread(cluster.rules)
    return row


async def overload_row(cluster: Cluster, *, factor: int = 3, tokens: int) -> Row:
    """``factor`` x the slots of every worker offered at once, after an unloaded run of half the slots.

    Callers give up at the first refusal (``retry_deadline_s=0``), so each refusal is counted with its hint.
    """
    capacity = cluster.config.slots * len(cluster.workers)
    timeout_s = 3 * tokens / cluster.config.tokens_per_s + 120
    addresses = [r.address for r in cluster.routers]
    async with Client(addresses, retry_deadline_s=0) as client:
        unloaded = await _run(client, "unloaded", max(1, capacity // 2), tokens, timeout_s)
        began = time.monotonic()
        offered = await _run(client, "overload", factor * capacity, tokens, timeout_s)
    row = summarize(f"overload {factor}x", offered, tokens, began)
    base = sorted(g for t in unloaded for g in t.gaps())
    loaded = sorted(g for t in offered if t.admitted for g in t.gaps())
    if base and loaded:
        row.note = f"inter-token gap p99 {percentile(loaded, 99):.3f} s (unloaded {percentile(base, 99):.3f} s)"
    row.broken += sum(t.broken(tokens) for t in unloaded)
    row.moved += sum(bool(t.migrations) for t in unloaded)  # a stall read from the mesh's own lag moves streams
    row.strays = await strays(cluster)
    row.rules = await asyncio.to_thread(cluster.rules)
    return row


async def _run(client: Client, label: str, count: int, tokens: int, timeout_s: float) -> list[Trace]:
    """count generations at once, each to its end."""
    traces = [Trace() for _ in range(count)]
    await asyncio.gather(*(call(client, request(label, i, tokens), t, timeout_s) for i, t in enumerate(traces)))
    return traces
