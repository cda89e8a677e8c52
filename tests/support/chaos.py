"""Fault rows on a :class:`~tests.support.cluster.Cluster`: callers through ``tokenmesh.client`` while one
fault hits the cluster, and what they saw.

In a fault row each caller runs generations back to back (so some arrive during the fault); the row waits until
every generation streams, injects its fault, waits until the routers route to the victim again, then lets each
caller finish its generation. A generation is **broken** when it was admitted (it got a chunk) and then ended in
an error, skipped or repeated a ``seq``, or ended with other than the tokens asked for. **Time to detect**: from
the fault until every router stops routing new work to the victim (its table row is not SERVING, has weight 0,
or says the router avoids it). **Failover gap**: per generation that moved to another worker (its final chunk's
``migrations``), the longest wait for a chunk (the first one included) after the fault. **Time to recover**: from
the heal (or the restart) until every router routes to the victim again. **Strays**: processes left in the pods
that belong to no running service.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from tests.support.cluster import Cluster, Service, routable
from tokenmesh.bench.metrics import percentile
from tokenmesh.client import Client
from tokenmesh.errors import MeshError, ResourceExhausted
from tokenmesh.v1 import inference_pb2, router_pb2, router_pb2_grpc

POLL_S = 0.05
"""How often the routers' tables are read while a fault lasts."""


@dataclass
class Trace:
    """What one caller saw of one generation."""

    started: float = field(default_factory=time.monotonic)
    """time.monotonic() when the caller asked for it."""
    arrivals: list[float] = field(default_factory=list)
    """time.monotonic() of each chunk."""
    seq_ok: bool = True
    tokens: int = 0
    completion_tokens: int = 0
    finish: int = 0
    migrations: int = 0
    error: str = ""
    refused_with_hint: bool = False
    """Refused (RESOURCE_EXHAUSTED) with a retry hint."""

    def add(self, chunk: inference_pb2.GenerateChunk) -> None:
        """Account for one chunk."""
        self.arrivals.append(time.monotonic())
        self.seq_ok &= chunk.seq == len(self.arrivals)
        self.tokens += chunk.token_count
        if chunk.finish_reason:
            self.finish = chunk.finish_reason
            self.completion_tokens = chunk.usage.completion_tokens
            self.migrations = chunk.migrations

    @property
    def admitted(self) -> bool:
        """The mesh started it (a chunk arrived)."""
        return bool(self.arrivals)

    def broken(self, tokens: int) -> bool:
        """Admitted, then an error, a seq gap or repeat, or not the tokens asked for."""
        whole = self.seq_ok and self.finish != 0 and self.tokens == self.completion_tokens == tokens
        return self.admitted and (bool(self.error) or not whole)

    def gaps(self, after: float = 0.0, *, from_start: bool = False) -> list[float]:
        """Seconds between consecutive chunks (from_start: the wait for the first chunk too), for each chunk that
        arrived after ``after``."""
        times = [self.started, *self.arrivals] if from_start else self.arrivals
        pairs = zip(times, times[1:], strict=False)
        return [b - a for a, b in pairs if b > after]


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
    detect_s: float | None = None
    gap_p50_s: float | None = None
    gap_p99_s: float | None = None
    recover_s: float | None = None
    strays: list[int] = field(default_factory=list)
    note: str = ""
    problems: list[str] = field(default_factory=list)
    """The first broken streams, described."""

    HEADER = (
        f"{'row':<22} {'offered':>7} {'admitted':>8} {'refused':>7} {'no hint':>7} {'broken':>6} {'moved':>5} "
        f"{'detect s':>8} {'gap p50':>7} {'gap p99':>7} {'recover s':>9} {'strays':>6}  note"
    )

    def line(self) -> str:
        """The row, under HEADER."""
        return (
            f"{self.name:<22} {self.offered:>7} {self.admitted:>8} {self.refused:>7} {self.refused_without_hint:>7} "
            f"{self.broken:>6} {self.moved:>5} {_s(self.detect_s):>8} {_s(self.gap_p50_s):>7} "
            f"{_s(self.gap_p99_s):>7} {_s(self.recover_s):>9} {len(self.strays):>6}  {self.note}"
        )


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def request(label: str, index: int, tokens: int) -> inference_pb2.GenerateRequest:
    """A generation of exactly ``tokens`` tokens, with a prompt of its own (the prefix policy spreads them)."""
    return inference_pb2.GenerateRequest(
        prompt=f"{label} caller {index}: once upon a time", max_tokens=tokens, ignore_eos=True, seed=index
    )


async def call(client: Client, req: inference_pb2.GenerateRequest, trace: Trace, timeout_s: float) -> None:
    """One caller: read the generation to its end into trace (an error is recorded, not raised)."""
    try:
        async for chunk in client.generate(req, timeout=timeout_s):
            trace.add(chunk)
    except MeshError as exc:
        trace.error = f"{type(exc).__name__}: {exc}"
        trace.refused_with_hint = isinstance(exc, ResourceExhausted) and exc.retry_delay is not None


async def until_streaming(traces: list[Trace], chunks: int = 3, timeout_s: float = 120) -> None:
    """Until every generation got ``chunks`` chunks or ended."""
    deadline = time.monotonic() + timeout_s
    while not all(len(t.arrivals) >= chunks or t.error or t.finish for t in traces):
        if time.monotonic() > deadline:
            raise TimeoutError(f"generations not streaming after {timeout_s:g} s")
        await asyncio.sleep(POLL_S)


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
    _victim: Service
    _channels: dict[str, grpc.aio.Channel]

    def __init__(self, cluster: Cluster, victim: Service) -> None:
        self.changes = {r.name: [] for r in cluster.routers}
        self.link_lost = {}
        self._victim = victim
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
        """From the heal until the last router routed to the victim again (None: one does not)."""
        if not self.recovered():
            return None
        return max([0.0, *(c[-1][0] - heal_at for c in self.changes.values() if c)])

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
    recover_timeout_s: float = 120,
) -> Row:
    """``streams`` callers, each running generations of ``tokens`` tokens back to back, while ``fault`` hits
    worker ``victim``; the row ends once every router routes to it again (and each caller's last generation
    ended)."""
    watched = cluster.workers[victim]
    watch = Watch(cluster, watched)
    watching = asyncio.create_task(watch.run())
    traces: list[Trace] = []
    stop = asyncio.Event()
    timeout_s = 3 * tokens / cluster.config.tokens_per_s + 120
    async with Client([r.address for r in cluster.routers]) as client:
        callers = [
            asyncio.create_task(caller(client, f"{name} {i}", tokens, timeout_s, stop, traces)) for i in range(streams)
        ]
        try:
            await asyncio.sleep(0)  # each caller has begun its first generation
            await until_streaming(list(traces))
            fault_at, heal_at = await fault(cluster, watched)
            deadline = time.monotonic() + recover_timeout_s
            while not watch.recovered() and time.monotonic() < deadline:
                await asyncio.sleep(POLL_S)
            stop.set()
            await asyncio.gather(*callers)
        finally:
            for task in (*callers, watching):
                task.cancel()
            await asyncio.gather(*callers, watching, return_exceptions=True)
            await watch.close()
    row = summarize(name, traces, tokens, fault_at)
    row.detect_s = watch.detected_s(fault_at)
    row.recover_s = watch.recovered_s(heal_at)
    notes = []
    if back := watch.back_during(fault_at, heal_at):
        notes.append(f"routers took the victim back {back} time(s) while the fault lasted")
    if len(watch.link_lost) == len(watch.changes):  # when the link's keepalive gave up on a silent peer
        notes.append(f"links down after {max(watch.link_lost.values()) - fault_at:.1f} s")
    if late := sum(bool(t.migrations) and t.started > fault_at for t in traces):
        notes.append(f"{late} generation(s) that began after the fault moved")
    row.note = "; ".join(notes)
    row.strays = await strays(cluster)
    return row


async def caller(
    client: Client, label: str, tokens: int, timeout_s: float, stop: asyncio.Event, traces: list[Trace]
) -> None:
    """Generations one after another until stop is set, each recorded in traces."""
    while not stop.is_set():
        trace = Trace()
        traces.append(trace)
        await call(client, request(label, len(traces), tokens), trace, timeout_s)


async def strays(cluster: Cluster, grace_s: float = 15) -> list[int]:
    """Processes in the pods that belong to no running service once grace_s passed (a killed worker's Triton
    stubs notice their parent is gone within a few seconds)."""
    deadline = time.monotonic() + grace_s
    while (found := cluster.strays()) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    return found


def summarize(name: str, traces: list[Trace], tokens: int, fault_at: float) -> Row:
    """Counts and failover gaps of a row's generations."""
    row = Row(name, len(traces))
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


def silent_partition(seconds: float) -> Fault:
    """Drop every packet between the worker and the routers, both ways (no RST), for seconds; then heal."""

    async def fault(cluster: Cluster, victim: Service) -> tuple[float, float]:
        await asyncio.to_thread(cluster.partition, victim, cluster.routers)
        fault_at = time.monotonic()
        try:
            await asyncio.sleep(seconds)
        finally:
            await asyncio.to_thread(cluster.partition, victim, cluster.routers, heal=True)
        return fault_at, time.monotonic()

    return fault


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
    return row


async def _run(client: Client, label: str, count: int, tokens: int, timeout_s: float) -> list[Trace]:
    """count generations at once, each to its end."""
    traces = [Trace() for _ in range(count)]
    await asyncio.gather(*(call(client, request(label, i, tokens), t, timeout_s) for i, t in enumerate(traces)))
    return traces
