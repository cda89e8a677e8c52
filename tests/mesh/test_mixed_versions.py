"""A rolling upgrade: routers and workers with and without Worker/Link serve together (negotiated per worker).

An "old worker" is a worker whose Link answers UNIMPLEMENTED, as one built before the call; an "old router" is
one with ``worker_link="off"``, which never calls Link. Real in-process meshes, dozens of streams each.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from tests.support.fakes import FakeBackend
from tests.support.mesh import InProcessMesh, assert_exact, wait_until
from tokenmesh.errors import Unimplemented
from tokenmesh.router import Router, RouterConfig
from tokenmesh.router._spares import SPARE
from tokenmesh.v1 import inference_pb2, router_pb2
from tokenmesh.worker import Worker, WorkerConfig, WorkerServicer

STREAMS = 32


class Versions:
    """WorkerServicer.Link as each worker's version has it: UNIMPLEMENTED on the old ones; every Link call counted."""

    old: set[WorkerServicer]
    calls: dict[WorkerServicer, int]

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.old = set()
        self.calls = {}
        new_link = WorkerServicer.Link
        versions = self

        async def link(self: WorkerServicer, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
            versions.calls[self] = versions.calls.get(self, 0) + 1
            if self in versions.old:
                raise Unimplemented("Method not implemented!")  # what a worker built before Link answers
            async for events in new_link(self, request_iterator, context):
                yield events

        # On the class, before any worker registers its handlers (they bind the method then).
        monkeypatch.setattr(WorkerServicer, "Link", link)


@pytest.fixture
def versions(monkeypatch: pytest.MonkeyPatch) -> Versions:
    return Versions(monkeypatch)


@contextlib.asynccontextmanager
async def mixed_mesh(versions: Versions, old: tuple[bool, bool], worker_link: str) -> AsyncIterator[InProcessMesh]:
    """Two workers over FakeBackend (old[i]: worker i predates Link) and a router with worker_link."""
    backends = [FakeBackend(delay=0.005), FakeBackend(delay=0.005)]
    workers = [Worker(WorkerConfig(port=0, drain_grace_s=1), backend=b) for b in backends]
    versions.old.update(w.servicer for w, is_old in zip(workers, old, strict=True) if is_old)
    router: Router | None = None
    channel: grpc.aio.Channel | None = None
    try:
        for w in workers:
            await w.start()
        addresses = tuple(w.host.address for w in workers)
        router = Router(RouterConfig(port=0, workers=addresses, drain_grace_s=1, worker_link=worker_link))
        await router.start()
        channel = grpc.aio.insecure_channel(router.host.address)
        entries = router.pool.entries
        await wait_until(lambda: all(e.healthy and e.models for e in entries.values()))
        if worker_link == "auto":
            modes = router.transports.modes
            await wait_until(lambda: all(a in modes for a in addresses))
        for b in backends:
            b.started.clear()
        yield InProcessMesh(router, workers, backends, channel)
    finally:
        if channel is not None:
            await channel.close()
        if router is not None:
            await router.shutdown()
        for w in workers:
            await w.shutdown()


async def run_streams(mesh: InProcessMesh, max_tokens: int) -> list[list[inference_pb2.GenerateChunk]]:
    """STREAMS generations at once, each read to its end; every one exact."""

    async def one(i: int) -> list[inference_pb2.GenerateChunk]:
        request = inference_pb2.GenerateRequest(prompt=f"p{i}", max_tokens=max_tokens)
        return [c async for c in mesh.inference.Generate(request, timeout=30)]

    runs = await asyncio.gather(*(one(i) for i in range(STREAMS)))
    for chunks in runs:
        assert_exact(chunks, max_tokens)
    return runs


async def link_fields(mesh: InProcessMesh) -> dict[str, str]:
    """RoutingEntry.link per worker address, as GetRoutingTable says."""
    table = await mesh.operator.GetRoutingTable(router_pb2.GetRoutingTableRequest())
    return {w.address: w.link for w in table.workers}


async def test_a_new_router_serves_an_old_worker_per_generation_and_a_new_one_over_its_link(versions: Versions) -> None:
    async with mixed_mesh(versions, (True, False), "auto") as mesh:
        old, new = (w.host.address for w in mesh.workers)
        assert mesh.router.transports.modes == {old: "per-generation", new: "batched"}
        assert await link_fields(mesh) == {old: "per-generation", new: "batched"}
        await run_streams(mesh, 25)
        assert all(len(b.started) > 0 for b in mesh.backends)  # both versions served
        assert sum(len(b.started) for b in mesh.backends) == STREAMS
        # The old worker got Generate calls (spares opened ahead for it), the new one none.
        assert mesh.router.links[old].held(SPARE) is not None and mesh.router.links[new].held(SPARE) is None
        # The old worker was asked once (at its link's start), not per generation.
        assert versions.calls[mesh.workers[0].servicer] == 1


async def test_an_old_router_serves_new_workers_with_a_generate_call_per_generation(versions: Versions) -> None:
    async with mixed_mesh(versions, (False, False), "off") as mesh:
        await run_streams(mesh, 25)
        assert all(len(b.started) > 0 for b in mesh.backends)
        assert not versions.calls  # it never calls Link
        assert not mesh.router.transports.modes
        assert set((await link_fields(mesh)).values()) == {"per-generation"}


@pytest.mark.parametrize("failing", ["old", "new"])
async def test_mid_stream_failover_between_an_old_and_a_new_worker_keeps_seq_and_text_exact(
    versions: Versions, failing: str
) -> None:
    async with mixed_mesh(versions, (True, False), "auto") as mesh:
        broken = mesh.backends[0 if failing == "old" else 1]
        other = mesh.backends[1 if failing == "old" else 0]
        broken.fail_after = 6  # every generation that starts there fails after 6 tokens
        runs = await run_streams(mesh, 30)
        moved = [chunks for chunks in runs if chunks[-1].migrations]
        # Each generation that started on the broken worker was continued on the other (link <-> Generate).
        assert len(moved) == len(broken.started) > 0
        assert all(chunks[-1].migrations == 1 for chunks in moved)
        assert len(other.started) == STREAMS  # every generation ran there, first or as a continuation
        assert sum(1 for g in other.started if g.params.max_tokens < 30) == len(moved)  # continuations: the rest


async def test_an_old_worker_upgraded_in_place_is_asked_again_and_gets_the_link(versions: Versions) -> None:
    async with mixed_mesh(versions, (True, False), "auto") as mesh:
        old = mesh.workers[0]
        address = old.host.address
        modes = mesh.router.transports.modes
        assert modes[address] == "per-generation"
        await run_streams(mesh, 10)
        await old.shutdown()  # the upgrade: the same address, a new version behind it
        host, _, port = address.rpartition(":")
        upgraded = Worker(WorkerConfig(host=host, port=int(port), drain_grace_s=1), backend=mesh.backends[0])
        mesh.workers[0] = upgraded  # stopped by the fixture
        await upgraded.start()
        await wait_until(lambda: modes.get(address) == "batched", timeout=15)
        assert (await link_fields(mesh))[address] == "batched"
        assert versions.calls[upgraded.servicer] == 1
        # Placed only once its health watch, reconnecting with backoff (seconds on a loaded machine), sees it again.
        entry = mesh.router.pool.entries[address]
        await wait_until(lambda: entry.healthy and bool(entry.models), timeout=15)
        for b in mesh.backends:
            b.started.clear()
        await run_streams(mesh, 10)
        # The upgraded worker serves, over its link (an attempt takes the open session before any spare).
        assert mesh.backends[0].started and mesh.router.transports.sessions.get(address) is not None
