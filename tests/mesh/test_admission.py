"""Priority admission: per-worker limits, HIGH before LOW, aging, tenants, bounded queue."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from tests.support.mesh import InProcessMesh, in_process_mesh, wait_until
from tokenmesh.v1 import inference_pb2, router_pb2

SLOTS = 8  # two fake workers x 4 slots


async def fill(mesh: InProcessMesh, n: int = SLOTS, **fields) -> list:
    """Start n long generations and wait until they all run."""
    for b in mesh.backends:
        b.delay = 0.05
    calls = [
        mesh.inference.Generate(inference_pb2.GenerateRequest(prompt=f"fill{i}", max_tokens=400, **fields))
        for i in range(n)
    ]
    await asyncio.gather(*(c.read() for c in calls))
    return calls


def started_prompts(mesh: InProcessMesh) -> list[str]:
    generations = sorted((g for b in mesh.backends for g in b.started), key=lambda g: g.started_at)
    return [g.params.prompt for g in generations]


def queued(mesh: InProcessMesh) -> int:
    return len(mesh.router.admission.waiting)


def level_now(mesh: InProcessMesh, index: int) -> float:
    """The effective (aged) level of the index-th waiter."""
    admission = mesh.router.admission
    return admission._effective(admission.waiting[index], time.monotonic())[0]


async def test_router_never_sends_a_worker_more_than_its_limit(mesh: InProcessMesh) -> None:
    calls = await fill(mesh)
    extra = [mesh.inference.Generate(inference_pb2.GenerateRequest(prompt=f"extra{i}", max_tokens=2)) for i in range(4)]
    await wait_until(lambda: queued(mesh) == 4)  # they wait in the router, not on the workers
    # Nothing should change now; 0.2 s is ample for a wrongly granted slot to reach a worker on loopback.
    await asyncio.sleep(0.2)
    assert [w.servicer.in_flight for w in mesh.workers] == [4, 4]
    table = await mesh.operator.GetRoutingTable(router_pb2.GetRoutingTableRequest())
    assert table.queued == 4 and all(w.concurrency_limit == 4 and w.in_flight == 4 for w in table.workers)
    for call in calls:
        call.cancel()
    for call in extra:  # slots freed: the waiting ones run
        assert [c async for c in call][-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH


async def test_high_priority_queued_behind_low_starts_first(mesh: InProcessMesh) -> None:
    running = await fill(mesh)
    low = mesh.inference.Generate(
        inference_pb2.GenerateRequest(prompt="low", max_tokens=2, priority=inference_pb2.PRIORITY_LOW)
    )
    low_read = asyncio.create_task(low.read())
    await wait_until(lambda: queued(mesh) == 1)
    high = mesh.inference.Generate(
        inference_pb2.GenerateRequest(prompt="high", max_tokens=2, priority=inference_pb2.PRIORITY_HIGH)
    )
    high_read = asyncio.create_task(high.read())
    await wait_until(lambda: queued(mesh) == 2)
    running[0].cancel()  # one slot frees
    await asyncio.wait_for(high_read, 5)
    assert not low_read.done() or started_prompts(mesh).index("high") < started_prompts(mesh).index("low")
    running[1].cancel()
    await asyncio.wait_for(low_read, 5)
    prompts = started_prompts(mesh)
    assert prompts.index("high") < prompts.index("low")
    for call in running:
        call.cancel()


async def test_low_priority_cannot_starve() -> None:
    async with in_process_mesh(aging_s=0.1) as mesh:
        running = await fill(mesh)
        low = mesh.inference.Generate(
            inference_pb2.GenerateRequest(prompt="low", max_tokens=2, priority=inference_pb2.PRIORITY_LOW)
        )
        low_read = asyncio.create_task(low.read())
        await wait_until(lambda: queued(mesh) == 1)
        # Aged from LOW (1) by 4 levels, to 5: above a HIGH (3) arriving now, even once that one ages a level too.
        await wait_until(lambda: level_now(mesh, 0) >= 5, timeout=5)
        high = mesh.inference.Generate(
            inference_pb2.GenerateRequest(prompt="high", max_tokens=2, priority=inference_pb2.PRIORITY_HIGH)
        )
        high_read = asyncio.create_task(high.read())
        await wait_until(lambda: queued(mesh) == 2)
        running[0].cancel()
        await asyncio.wait_for(low_read, 5)
        running[1].cancel()
        await asyncio.wait_for(high_read, 5)
        prompts = started_prompts(mesh)
        assert prompts.index("low") < prompts.index("high")
        for call in running:
            call.cancel()


async def test_tenant_with_less_running_goes_first(mesh: InProcessMesh) -> None:
    running = await fill(mesh, labels={"tenant": "big"})
    big = mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="big", max_tokens=2, labels={"tenant": "big"}))
    big_read = asyncio.create_task(big.read())
    await wait_until(lambda: queued(mesh) == 1)
    small = mesh.inference.Generate(
        inference_pb2.GenerateRequest(prompt="small", max_tokens=2, labels={"tenant": "small"})
    )
    small_read = asyncio.create_task(small.read())
    await wait_until(lambda: queued(mesh) == 2)
    running[0].cancel()
    await asyncio.wait_for(small_read, 5)  # same priority, but "small" runs nothing yet
    running[1].cancel()
    await asyncio.wait_for(big_read, 5)
    prompts = started_prompts(mesh)
    assert prompts.index("small") < prompts.index("big")
    for call in running:
        call.cancel()


async def test_full_queue_answers_resource_exhausted_with_a_retry_hint() -> None:
    async with in_process_mesh(max_queue=1) as mesh:
        running = await fill(mesh)
        waiting = mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="w", max_tokens=2))
        waiting_read = asyncio.create_task(waiting.read())
        await wait_until(lambda: queued(mesh) == 1)
        refused = mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="x", max_tokens=2))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await refused.read()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in info.value.details()
        hint = dict(info.value.trailing_metadata() or ())
        assert int(hint["retry-after-ms"]) > 0
        for call in running:
            call.cancel()
        await asyncio.wait_for(waiting_read, 5)


async def test_queue_wait_is_bounded() -> None:
    async with in_process_mesh(queue_timeout_s=0.3) as mesh:
        running = await fill(mesh)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="late", max_tokens=2)).read()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "within 0.3 s" in info.value.details()
        assert "retry-after-ms" in dict(info.value.trailing_metadata() or ())
        assert queued(mesh) == 0
        for call in running:
            call.cancel()
