"""The in-process mesh the unit and mesh tests share: two workers over FakeBackend and a router, on 127.0.0.1:0."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2_grpc

from tokenmesh.errors import ErrorInterceptor
from tokenmesh.router import Router, RouterConfig
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tokenmesh.worker import Worker, WorkerConfig

from .fakes import FakeBackend

ROADS = ("auto", "off")
"""The router's two roads to a worker: ``Worker/Link`` (the default) and a ``Worker/Generate`` call per generation
(the fallback of a rolling upgrade)."""
_road: list[str] = []
"""The road the ``mesh_road`` fixture set for the test that runs now (empty: the router's default)."""


@pytest.fixture(params=ROADS)
def mesh_road(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test once down each road: every in-process mesh it starts has this ``worker_link`` by default."""
    _road.append(request.param)
    try:
        yield request.param
    finally:
        _road.clear()


@dataclass
class InProcessMesh:
    router: Router
    workers: list[Worker]
    backends: list[FakeBackend]
    channel: grpc.aio.Channel

    @property
    def inference(self) -> inference_pb2_grpc.InferenceStub:
        return inference_pb2_grpc.InferenceStub(self.channel)

    @property
    def operator(self) -> router_pb2_grpc.RouterStub:
        return router_pb2_grpc.RouterStub(self.channel)


async def wait_until(predicate, timeout: float = 5.0, interval: float = 0.02) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval)


async def stats(mesh: InProcessMesh, i: int) -> worker_pb2.WorkerStats:
    """One answer of worker i's Stats stream."""
    async with grpc.aio.insecure_channel(mesh.workers[i].host.address) as channel:
        call = worker_pb2_grpc.WorkerStub(channel).Stats()
        await call.write(worker_pb2.StatsPing(ping_id=1))
        result = await call.read()
        call.cancel()
        return result


@contextlib.asynccontextmanager
async def in_process_mesh(
    worker_settings: dict[str, object] | None = None,
    backend_settings: dict[str, Any] | None = None,
    *,
    per_backend: tuple[dict[str, Any], ...] = (),
    worker_count: int = 2,
    **router_settings: object,
) -> AsyncIterator[InProcessMesh]:
    """``worker_count`` workers (two) over FakeBackend and a router (no prober: even split over healthy workers).

    ``per_backend``: settings of each worker's FakeBackend on top of ``backend_settings``, by worker (one worker's
    adapters); workers past its end get none.

    The router's ``worker_link`` defaults to the ``mesh_road`` fixture's road (else the router's default, auto); with
    the link on, the mesh is ready once each worker's link is open (or refused).
    """
    if _road:
        router_settings.setdefault("worker_link", _road[0])
    own = [*per_backend, *[{}] * worker_count][:worker_count]
    backends = [FakeBackend(**(backend_settings or {}), **settings) for settings in own]
    started = [Worker(WorkerConfig(port=0, drain_grace_s=1, **(worker_settings or {})), backend=b) for b in backends]
    router: Router | None = None
    channel: grpc.aio.Channel | None = None
    try:  # everything started is stopped, also when a later start fails
        for w in started:
            await w.start()
        router = Router(
            RouterConfig(port=0, workers=tuple(w.host.address for w in started), drain_grace_s=1, **router_settings)
        )
        await router.start()
        channel = grpc.aio.insecure_channel(router.host.address)
        pool = router.pool
        await wait_until(lambda: all(e.healthy and e.models for e in pool.entries.values()))
        if router.config.worker_link == "auto":
            modes = router.transports.modes  # "batched" once a link is open; an old worker's "per-generation"
            await wait_until(lambda: all(w.host.address in modes for w in started))
        for b in backends:
            b.started.clear()  # forget the warm-up generations
        yield InProcessMesh(router, started, backends, channel)
    finally:
        if channel is not None:
            await channel.close()
        if router is not None:
            await router.shutdown()
        for w in started:
            await w.shutdown()


@pytest.fixture
async def mesh() -> AsyncIterator[InProcessMesh]:
    async with in_process_mesh() as m:
        yield m


@contextlib.asynccontextmanager
async def behind_error_interceptor(servicer: health_pb2_grpc.HealthServicer) -> AsyncIterator[grpc.aio.Channel]:
    """A channel to a server running ``servicer`` (a Health servicer that raises) behind the ErrorInterceptor."""
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(0)


async def collect(mesh: InProcessMesh, **fields: Any) -> list[inference_pb2.GenerateChunk]:
    """Every chunk of one Generate through the mesh's router."""
    return [c async for c in mesh.inference.Generate(inference_pb2.GenerateRequest(**fields))]


def expected_text(n: int) -> str:
    """What the fake backend streams for n tokens."""
    return "".join(f"tok{i} " for i in range(n))


def assert_exact(chunks: list[inference_pb2.GenerateChunk], n: int) -> None:
    """seq 1..N, the n tokens' text once each (nothing repeated, nothing lost), a LENGTH end counting n."""
    assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1))
    assert "".join(c.text for c in chunks) == expected_text(n)
    assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert chunks[-1].usage.completion_tokens == n == sum(c.token_count for c in chunks)
