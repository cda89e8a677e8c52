"""The router on its workers' Worker/Link (--worker-link auto): per-generation semantics over one call per worker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from tests.support.fakes import FakeBackend
from tests.support.mesh import InProcessMesh, assert_exact, collect, in_process_mesh, wait_until
from tests.support.tcp_proxy import TcpProxy
from tokenmesh.errors import Unimplemented
from tokenmesh.router import Router, RouterConfig
from tokenmesh.router._spares import SPARE
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, router_pb2
from tokenmesh.worker import Worker, WorkerConfig, WorkerServicer


async def links(mesh: InProcessMesh) -> list[str]:
    """RoutingEntry.link of each worker, as GetRoutingTable says."""
    table = await mesh.operator.GetRoutingTable(router_pb2.GetRoutingTableRequest())
    return [w.link for w in table.workers]


def spares(router: Router) -> list[Any]:
    return [c for _, link in router.links.items() if (c := link.held(SPARE)) is not None]


async def test_generations_share_one_link_per_worker_with_exact_seq_and_no_call_each() -> None:
    async with in_process_mesh(worker_link="auto") as mesh:
        runs = await asyncio.gather(*(collect(mesh, prompt=f"p{i}", max_tokens=20 + i) for i in range(8)))
        for i, chunks in enumerate(runs):
            assert_exact(chunks, 20 + i)
            assert chunks[-1].timing.router_ttft_ms > 0 and chunks[-1].timing.engine_ttft_ms > 0
        assert sum(len(b.started) for b in mesh.backends) == 8
        assert all(len(b.started) > 0 for b in mesh.backends)  # spread over both workers
        assert not spares(mesh.router)  # no Worker/Generate call was opened
        assert mesh.router.transports.modes == {w.host.address: "batched" for w in mesh.workers}
        assert await links(mesh) == ["batched", "batched"]


async def test_the_callers_deadline_reaches_the_engine_through_the_link() -> None:
    async with in_process_mesh(worker_link="auto") as mesh:
        request = inference_pb2.GenerateRequest(prompt="hello", max_tokens=2)
        assert [c.seq async for c in mesh.inference.Generate(request, timeout=30)] == [1, 2, 3]
        started = [g for b in mesh.backends for g in b.started]
        assert started[0].params.timeout_s is not None and 25 < started[0].params.timeout_s <= 31


async def test_a_failing_worker_mid_stream_is_continued_elsewhere_on_its_link() -> None:
    async with in_process_mesh(worker_link="auto") as mesh:
        mesh.backends[0].fail_after = 4
        chunks = await collect(mesh, prompt="hello", max_tokens=12, seed=7)
        assert_exact(chunks, 12)
        assert chunks[-1].migrations == 1


@pytest.fixture
async def proxied() -> AsyncIterator[tuple[Router, list[FakeBackend], TcpProxy]]:
    """Two workers, the first behind a TCP proxy that can cut the connection; a router on their links."""
    backends = [FakeBackend(delay=0.02), FakeBackend(delay=0.02)]
    workers = [Worker(WorkerConfig(port=0, drain_grace_s=1), backend=b) for b in backends]
    proxy = TcpProxy("127.0.0.1", 0)
    router: Router | None = None
    try:
        for w in workers:
            await w.start()
        proxy = TcpProxy("127.0.0.1", workers[0].host.port)
        await proxy.start()
        addresses = (proxy.address, workers[1].host.address)
        router = Router(RouterConfig(port=0, workers=addresses, drain_grace_s=1, worker_link="auto"))
        await router.start()
        sessions = router.transports.sessions
        await wait_until(lambda: all(e.healthy and e.models for e in router.pool.entries.values()))
        await wait_until(lambda: all(a in sessions for a in addresses))
        yield router, backends, proxy
    finally:
        if router is not None:
            await router.shutdown()
        await proxy.stop()
        for w in workers:
            await w.shutdown()


async def test_a_cut_link_fails_every_stream_on_it_over_at_once_with_exact_seq(proxied: Any) -> None:
    router, backends, proxy = proxied
    async with grpc.aio.insecure_channel(router.host.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        calls = [stub.Generate(inference_pb2.GenerateRequest(prompt=f"p{i}", max_tokens=40)) for i in range(6)]
        got = [[await call.read() for _ in range(5)] for call in calls]
        on_proxy = [g for g in backends[0].started if g.params.max_tokens == 40]
        assert on_proxy, "some streams should run on the proxied worker"
        proxy.cut()
        for call, chunks in zip(calls, got, strict=True):
            while (chunk := await call.read()) is not grpc.aio.EOF:
                chunks.append(chunk)
    for chunks in got:
        assert_exact(chunks, 40)
    assert sum(c[-1].migrations for c in got) == len(on_proxy)
    # The worker behind the cut stops the orphaned generations (their router is gone, nobody can resume them).
    await asyncio.wait_for(asyncio.gather(*(g.cancelled.wait() for g in on_proxy)), 5)


async def test_cancel_reaches_the_backend_over_the_link_and_ends_cancelled() -> None:
    async with in_process_mesh(worker_link="auto", backend_settings={"delay": 0.05}) as mesh:
        call = mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="a", max_tokens=500, request_id="c1"))
        first = await call.read()
        assert (await mesh.inference.Cancel(inference_pb2.CancelRequest(request_id="c1"))).cancelled
        rest = []
        while (chunk := await call.read()) is not grpc.aio.EOF:
            rest.append(chunk)
        assert rest[-1].finish_reason == inference_pb2.FINISH_REASON_CANCELLED
        assert [c.seq for c in [first, *rest]] == list(range(1, 2 + len(rest)))
        assert [g.cancelled.is_set() for b in mesh.backends for g in b.started] == [True]
        # A caller that goes away: its non-resumable generation is stopped on the worker (link detach).
        dropped = mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="b", max_tokens=500))
        await dropped.read()
        dropped.cancel()
        await wait_until(lambda: sum(g.cancelled.is_set() for b in mesh.backends for g in b.started) == 2)


async def test_a_generation_is_resumed_through_attach_after_its_router_went_away() -> None:
    async with in_process_mesh(worker_link="auto", backend_settings={"delay": 0.03}) as mesh:
        call = mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="p", max_tokens=60, request_id="r1"))
        first = [await call.read() for _ in range(3)]
        await mesh.router.shutdown()  # its links go: the worker keeps the resumable generation
        addresses = tuple(w.host.address for w in mesh.workers)
        other = Router(RouterConfig(port=0, workers=addresses, drain_grace_s=1, worker_link="auto"))
        await other.start()
        try:
            await wait_until(lambda: all(e.healthy for e in other.pool.entries.values()))
            async with grpc.aio.insecure_channel(other.host.address) as channel:
                request = inference_pb2.ResumeRequest(request_id="r1", after_seq=3)
                rest = [c async for c in inference_pb2_grpc.InferenceStub(channel).Resume(request, timeout=10)]
        finally:
            await other.shutdown()
        chunks = first + rest
        assert_exact(chunks, 60)
        assert not any(g.cancelled.is_set() for b in mesh.backends for g in b.started)


async def test_a_worker_without_link_gets_a_generate_call_per_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    async def old_link(self: WorkerServicer, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        raise Unimplemented("Method not implemented!")
        yield  # pragma: no cover

    monkeypatch.setattr(WorkerServicer, "Link", old_link)  # both workers predate Link (UNIMPLEMENTED)
    async with in_process_mesh(worker_link="auto") as mesh:
        assert mesh.router.transports.modes == {w.host.address: "per-generation" for w in mesh.workers}
        assert_exact(await collect(mesh, prompt="hello", max_tokens=12), 12)
        assert spares(mesh.router)  # the per-generation path: a Generate call opened ahead
        assert await links(mesh) == ["per-generation", "per-generation"]


async def test_with_the_link_off_every_worker_gets_a_generate_call_per_generation() -> None:
    async with in_process_mesh(worker_link="off") as mesh:
        assert_exact(await collect(mesh, prompt="hello", max_tokens=5), 5)
        assert spares(mesh.router) and not mesh.router.transports.modes
        assert await links(mesh) == ["per-generation", "per-generation"]


async def test_callers_that_stop_reading_hold_back_only_their_own_generations_on_a_shared_link() -> None:
    settings = {"delay": 0.001, "max_context": 4096}
    async with in_process_mesh(worker_link="auto", stall_timeout_s=0.5, backend_settings=settings) as mesh:
        # A small window on the slow callers' side: the router soon waits on them, with their streams' credit spent.
        options = (("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 4096))
        async with grpc.aio.insecure_channel(mesh.router.host.address, options=options) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            slow = [stub.Generate(inference_pb2.GenerateRequest(prompt=f"s{i}", max_tokens=1500)) for i in range(2)]
            got = [[await call.read()] for call in slow]
            fast = await asyncio.wait_for(
                asyncio.gather(*(collect(mesh, prompt=f"f{i}", max_tokens=200) for i in range(6))), 10
            )
            for chunks in fast:
                assert_exact(chunks, 200)
            assert all(b.started for b in mesh.backends)  # slow and fast callers shared both links
            await asyncio.sleep(1.5)  # three stall windows without reading
            for call, chunks in zip(slow, got, strict=True):
                while (chunk := await call.read()) is not grpc.aio.EOF:
                    chunks.append(chunk)
        for chunks in got:
            assert_exact(chunks, 1500)
            assert chunks[-1].migrations == 0  # a slow caller is not a stalled worker


async def test_streams_on_a_link_run_to_their_end_across_a_renewal_while_new_ones_take_the_new_link() -> None:
    async with in_process_mesh(worker_link="auto", backend_settings={"delay": 0.02}) as mesh:
        sessions = mesh.router.transports.sessions
        old = dict(sessions)
        calls = [
            mesh.inference.Generate(inference_pb2.GenerateRequest(prompt=f"o{i}", max_tokens=60)) for i in range(24)
        ]
        got = [[await call.read() for _ in range(3)] for call in calls]
        mesh.router.links.renew()  # new certificates: a new channel per worker, and a new one for its link
        await wait_until(lambda: all(a in sessions and sessions[a] is not s for a, s in old.items()))
        assert all(s.retired and s.streams for s in old.values())  # draining: its streams run on, no new ones
        fresh = [
            mesh.inference.Generate(inference_pb2.GenerateRequest(prompt=f"n{i}", max_tokens=30)) for i in range(8)
        ]
        later = [[await call.read()] for call in fresh]
        assert sum(len(sessions[a].streams) for a in old) == 8  # every new generation on a new link
        for call, chunks in zip([*calls, *fresh], [*got, *later], strict=True):
            while (chunk := await call.read()) is not grpc.aio.EOF:
                chunks.append(chunk)
        for chunks in got:
            assert_exact(chunks, 60)
            assert chunks[-1].migrations == 0  # finished on the old link, not failed over
        for chunks in later:
            assert_exact(chunks, 30)
        # Drained: each old link closed its call once its last stream ended (its own channel with it).
        await wait_until(lambda: all(s.call.done() for s in old.values()))
        assert all(not s.streams for s in old.values())
        assert await links(mesh) == ["batched", "batched"]
