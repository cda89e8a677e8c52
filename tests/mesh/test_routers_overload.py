"""Two routers sending to the same two workers at 3x what those can run: refusals stay at the routers' door.

Each router takes a worker's whole concurrency limit as its own allowance, so two routers can send a worker twice
its limit. The workers here accept no more than their slots (``QUEUE_FACTOR`` 1), so every over-send is refused
with WORKER_AT_LIMIT: the routers must read that as "busy", not "failed" (no suspension, no attempt counted), put
the generation back at the head of their queue and send that worker less.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest

from tests.support.mesh import InProcessMesh, assert_exact, in_process_mesh, wait_until
from tokenmesh.errors import ResourceExhausted, from_rpc_error
from tokenmesh.router import Router, RouterConfig
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc
from tokenmesh.worker import Worker

SLOTS = 8
TOKENS = 30
DELAY_S = 0.01
"""One token per 10 ms per generation: a generation holds its slot ~0.3 s."""


@dataclass
class Tally:
    """What one worker saw: its peak in flight and the starts it refused."""

    peak: int = 0
    refused: int = 0


@dataclass
class Run:
    """What a burst did, over both routers and both workers."""

    workers: list[Tally]
    suspensions: list[str] = field(default_factory=list)
    chunks: list[list[inference_pb2.GenerateChunk]] = field(default_factory=list)
    errors: list[grpc.aio.AioRpcError] = field(default_factory=list)


def watch(worker: Worker) -> Tally:
    """Count worker's refusals and its peak of generations in flight (wrapping its admission and start)."""
    tally = Tally()
    servicer = worker.servicer
    admit, start = servicer._admit, servicer._start

    def counted_admit(request):  # type: ignore[no-untyped-def]
        try:
            return admit(request)
        except ResourceExhausted:
            tally.refused += 1
            raise

    def counted_start(first, params):  # type: ignore[no-untyped-def]
        record = start(first, params)
        tally.peak = max(tally.peak, servicer.in_flight)
        return record

    servicer._admit = counted_admit  # type: ignore[method-assign]
    servicer._start = counted_start  # type: ignore[method-assign]
    return tally


@contextlib.asynccontextmanager
async def shared_workers(**settings: object) -> AsyncIterator[tuple[InProcessMesh, Router]]:
    """Two workers of SLOTS slots (an engine queue behind them), the mesh's router and a second one over them."""
    async with in_process_mesh(backend_settings={"slots": SLOTS, "delay": DELAY_S}, **settings) as mesh:
        workers = tuple(w.host.address for w in mesh.workers)
        second = Router(RouterConfig(port=0, workers=workers, drain_grace_s=1, **settings))  # type: ignore[arg-type]
        await second.start()
        try:
            await wait_until(lambda: all(e.healthy and e.models for e in second.pool.entries.values()))
            for backend in mesh.backends:
                backend.engine_slots = asyncio.Semaphore(SLOTS)
            yield mesh, second
        finally:
            await second.shutdown()


async def burst(routers: list[Router], workers: list[Worker], callers: int) -> Run:
    """callers concurrent generations, alternating over the routers (one channel each, as a pinned caller)."""
    run = Run([watch(w) for w in workers])
    for router in routers:
        suspend = router.pool.suspend

        def recorded(entry, seconds, reason, suspend=suspend):  # type: ignore[no-untyped-def]
            run.suspensions.append(reason)
            suspend(entry, seconds, reason)

        router.pool.suspend = recorded  # type: ignore[method-assign]
    channels = [grpc.aio.insecure_channel(r.host.address) for r in routers]
    try:

        async def one(i: int) -> None:
            stub = inference_pb2_grpc.InferenceStub(channels[i % len(channels)])
            request = inference_pb2.GenerateRequest(prompt=f"q{i:02d}", max_tokens=TOKENS)
            try:
                run.chunks.append([c async for c in stub.Generate(request)])
            except grpc.aio.AioRpcError as exc:
                run.errors.append(exc)

        await asyncio.gather(*(one(i) for i in range(callers)))
    finally:
        for channel in channels:
            await channel.close()
    return run


@pytest.mark.parametrize("worker_link", ["auto", "off"])  # a refusal as a Link stream's end, and as a call's status
async def test_two_routers_at_3x_overload_refuse_at_their_door_and_never_over_send_a_worker(
    monkeypatch: pytest.MonkeyPatch, worker_link: str
) -> None:
    monkeypatch.setattr("tokenmesh.worker._limits.QUEUE_FACTOR", 1)  # a worker accepts its slots, no more
    callers = 3 * 2 * SLOTS
    async with shared_workers(max_queue=12, worker_link=worker_link) as (mesh, second):
        run = await burst([mesh.router, second], mesh.workers, callers)
        refusals = [
            r.metrics.registry.get_sample_value("tokenmesh_router_worker_refusals_total", {"worker": w.host.address})
            for r in (mesh.router, second)
            for w in mesh.workers
        ]
    figures = f"refusals {[t.refused for t in run.workers]}, peak {[t.peak for t in run.workers]} of {SLOTS} slots"
    assert all(t.peak == SLOTS for t in run.workers), figures  # every slot used, none over (QUEUE_FACTOR 1)
    # Each router sent each worker its whole limit at first (2 x SLOTS too many in all) and then no more than fit.
    assert 0 < sum(t.refused for t in run.workers) == sum(n or 0 for n in refusals) <= 2 * SLOTS, figures
    assert run.suspensions == []  # no worker was taken for failed, so none was left idle
    for error in run.errors:  # refused at the door (12 wait at each router), each with a retry hint
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        refusal = from_rpc_error(error)
        assert refusal.reason == "QUEUE_FULL" and refusal.retry_delay
    assert len(run.chunks) + len(run.errors) == callers
    assert len(run.chunks) >= 2 * (SLOTS + 12)  # both workers' slots and both queues were used
    for chunks in run.chunks:
        assert_exact(chunks, TOKENS)
