"""Prober against real worker and router servers (workers over the in-memory backend)."""

from __future__ import annotations

import asyncio
import time

from tests.support.mesh import InProcessMesh, wait_until
from tokenmesh.prober import Prober, ProberConfig
from tokenmesh.v1 import router_pb2
from tokenmesh.worker import DeviceReading


async def test_tables_reach_the_router_and_are_acked(mesh: InProcessMesh) -> None:
    addresses = tuple(w.host.address for w in mesh.workers)
    prober = Prober(ProberConfig(port=0, workers=addresses, routers=(mesh.router.host.address,), interval_s=0.05))
    await prober.start()
    try:
        pool = mesh.router.pool
        await wait_until(lambda: pool.version and all(pool.entries[a].weight == 1.0 for a in addresses))
        link = prober.routers[mesh.router.host.address]
        await wait_until(lambda: link.acked_version == prober.table.version)
        assert pool.version == prober.table.version
        assert 0 < pool.table().propagation_ms < 1000  # decided -> applied, on loopback

        # A worker that stops serving gets weight 0 at once (health Watch), well within 2 s.
        down = mesh.workers[0]
        started = time.monotonic()
        down.servicer.serving = False
        await down.host.set_ready(False)
        await wait_until(lambda: pool.entries[down.host.address].weight == 0.0, timeout=2)
        assert time.monotonic() - started < 2
        assert pool.entries[down.host.address].state == router_pb2.WORKER_STATE_NOT_SERVING

        # Its next stats, taken while it does not serve, take its limit out of the table (0: not measured serving).
        await wait_until(
            lambda: [w.concurrency_limit for w in prober.table.workers if w.address == down.host.address] == [0]
        )
        # An unchanged table is not pushed again. Proving that nothing happens takes a wait:
        # 0.3 s is six recompute rounds (interval_s 0.05), each of which would have pushed a change.
        version = prober.table.version
        await asyncio.sleep(0.3)
        assert prober.table.version == version
    finally:
        await prober.shutdown()


async def test_a_starting_prober_sends_no_table_before_it_probed_a_worker(mesh: InProcessMesh) -> None:
    """Its first table would otherwise call every worker unreachable ('not contacted yet'), which a router reads
    as the prober cut off from them (and warns about, at every start)."""
    addresses = tuple(w.host.address for w in mesh.workers)
    prober = Prober(ProberConfig(port=0, workers=addresses, routers=(mesh.router.host.address,), interval_s=0.05))
    seen: list[list[int]] = []
    apply = mesh.router.pool.apply

    def recording(table: router_pb2.WeightTable, adopt: bool = False) -> bool:
        seen.append([w.state for w in table.workers])
        return apply(table, adopt)

    mesh.router.pool.apply = recording  # type: ignore[method-assign]
    await prober.start()
    try:
        await wait_until(lambda: any(router_pb2.WORKER_STATE_SERVING in states for states in seen))
        assert [router_pb2.WORKER_STATE_UNREACHABLE] * len(addresses) not in seen
        assert not mesh.router.pool.prober_blind
    finally:
        await prober.shutdown()


async def test_a_prober_that_reaches_no_worker_still_sends_its_table_after_a_probe_timeout(
    mesh: InProcessMesh,
) -> None:
    gone = ("127.0.0.1:1", "127.0.0.1:2")  # nothing listens: every probe fails (or, filtered, times out)
    prober = Prober(ProberConfig(port=0, workers=gone, routers=(), interval_s=0.05, probe_timeout_s=0.3))
    await prober.start()
    try:
        await wait_until(lambda: prober.table.version > 0, timeout=3)
        assert {w.state for w in prober.table.workers} == {router_pb2.WORKER_STATE_UNREACHABLE}
    finally:
        await prober.shutdown()


async def test_gpu_memory_reading_over_the_threshold_lowers_that_workers_weight(mesh: InProcessMesh) -> None:
    """NVML read through the worker's device seam, with fixed readings, all the way to the router."""
    gib = 1024**3
    hot = mesh.workers[0]
    hot.servicer._devices = lambda: [DeviceReading(0, "NVIDIA H200", 135 * gib, 140 * gib, 97)]
    addresses = tuple(w.host.address for w in mesh.workers)
    prober = Prober(ProberConfig(port=0, workers=addresses, routers=(mesh.router.host.address,), interval_s=0.05))
    await prober.start()
    try:
        pool = mesh.router.pool
        entry, cool = pool.entries[hot.host.address], pool.entries[mesh.workers[1].host.address]
        await wait_until(lambda: pool.version and cool.weight == 1.0 and "memory" in entry.reason)
        assert "device 0 memory 96% > 92%" in entry.reason
        assert entry.weight == 0.45  # (1 - 135/140) / (1 - 0.92), rounded
    finally:
        await prober.shutdown()


async def test_the_prober_outlives_a_worker_that_goes_away_mid_stream(mesh: InProcessMesh) -> None:
    """A killed worker ends the stats stream under the prober's next ping: a transient failure, not a dead prober."""
    addresses = tuple(w.host.address for w in mesh.workers)
    prober = Prober(ProberConfig(port=0, workers=addresses, routers=(mesh.router.host.address,), interval_s=0.01))
    await prober.start()
    try:
        gone = mesh.workers[0]
        view = prober.views[gone.host.address]
        await wait_until(lambda: view.stats is not None and view.reachable)
        await gone.host.server.stop(0)  # as a SIGKILL: streams cut, nothing drained
        await wait_until(lambda: not view.reachable, timeout=5)
        await asyncio.sleep(1.0)  # 100 ping intervals: any failure of the loops would have surfaced by now
        assert prober.failure is None
        assert prober.host.health.status("readiness") == 1  # SERVING
        other = prober.views[mesh.workers[1].host.address]
        assert other.reachable and time.monotonic() - other.stats_at < 1
    finally:
        await prober.shutdown()
