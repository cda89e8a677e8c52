"""A router run as several processes on one port: connections spread, weights reach all, limits split."""

from __future__ import annotations

import asyncio

import grpc

from tests.support.fakes import FakeBackend
from tests.support.mesh import wait_until
from tokenmesh.prober import Prober, ProberConfig
from tokenmesh.router import Router, RouterConfig, WorkerEntry, WorkerPool
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, router_pb2, router_pb2_grpc
from tokenmesh.worker import Worker, WorkerConfig

# A channel of its own connection (grpc shares connections between channels by default).
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


def test_limit_shares_add_up_to_the_limit() -> None:
    for limit in range(1, 12):
        for count in (1, 2, 3, 4):
            entry = WorkerEntry("w", limit=limit)
            shares = [WorkerPool(share=(i, count)).allowance(entry) for i in range(count)]
            assert sum(shares) == limit and max(shares) - min(shares) <= 1


async def tables_by_process(address: str, connections: int = 24) -> dict[int, router_pb2.RoutingTable]:
    seen: dict[int, router_pb2.RoutingTable] = {}
    for _ in range(connections):
        async with grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as channel:
            table = await router_pb2_grpc.RouterStub(channel).GetRoutingTable(router_pb2.GetRoutingTableRequest())
            seen[table.process_index] = table
    return seen


async def test_two_router_processes_share_the_port_the_weights_and_the_limits() -> None:
    workers = [Worker(WorkerConfig(port=0, drain_grace_s=1), backend=FakeBackend(delay=0.01)) for _ in range(2)]
    router: Router | None = None
    prober = None
    try:
        for worker in workers:
            await worker.start()
        addresses = tuple(w.host.address for w in workers)
        router = Router(RouterConfig(port=0, workers=addresses, processes=2, drain_grace_s=1))
        await router.start()
        assert len(router._siblings) == 1 and router._siblings[0].poll() is None
        prober = Prober(ProberConfig(port=0, workers=addresses, routers=(router.host.address,), interval_s=0.05))
        await prober.start()
        # The prober's one stream lands on one process; the table reaches both, each using half of every limit.
        seen: dict[int, router_pb2.RoutingTable] = {}

        async def both_current() -> bool:
            seen.update(await tables_by_process(router.host.address))
            current = prober.table.version
            return set(seen) == {0, 1} and all(t.version == current and t.processes == 2 for t in seen.values())

        for _ in range(30):  # 3 s: a table passed on, not one the prober sent after reconnecting
            if await both_current():
                break
            await asyncio.sleep(0.1)
        assert set(seen) == {0, 1} and all(t.version == prober.table.version for t in seen.values()), seen
        for table in seen.values():
            assert [w.concurrency_limit for w in table.workers] == [2, 2]  # 4 slots each, split two ways
            assert all(w.weight > 0 for w in table.workers)

        # Streams through many connections: all complete, in order, on both processes.
        async def generate(i: int) -> list[int]:
            async with grpc.aio.insecure_channel(router.host.address, options=OWN_CONNECTION) as channel:
                stub = inference_pb2_grpc.InferenceStub(channel)
                request = inference_pb2.GenerateRequest(prompt=f"p{i}", max_tokens=5)
                return [c.seq async for c in stub.Generate(request)]

        results = await asyncio.gather(*(generate(i) for i in range(12)))
        assert results == [[1, 2, 3, 4, 5, 6]] * 12
        # Both processes served some: each counts only its own generations. The kernel spreads connections
        # by hash, so 12 on one process happen (p = 2^-11): then more streams, on new connections, until both did.
        served: dict[int, int] = {}
        for more in range(12, 60):
            tables = await tables_by_process(router.host.address)
            served = {i: sum(w.served_total for w in t.workers) for i, t in tables.items()}
            if set(served) == {0, 1} and all(served.values()):
                break
            assert await generate(more) == [1, 2, 3, 4, 5, 6]
        assert set(served) == {0, 1} and all(n > 0 for n in served.values()), served
        assert sum(served.values()) >= 12
    finally:
        if prober is not None:
            await prober.shutdown()
        if router is not None:
            await router.shutdown()
        for worker in workers:
            await worker.shutdown()
    sibling = router._siblings[0]
    assert sibling.poll() is not None  # stopped with the first process
    assert router.peers is not None
    directory = router.peers.directory
    await wait_until(lambda: not list(directory.glob("*.addr")), timeout=2)  # both processes unlisted themselves
