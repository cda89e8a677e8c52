"""Waiting generations go as soon as a worker can take them: the pool reports every change, nothing polls."""

from __future__ import annotations

import asyncio
import time

import grpc

from tests.support.mesh import InProcessMesh, in_process_mesh, wait_until
from tokenmesh.router import WorkerPool
from tokenmesh.v1 import inference_pb2, router_pb2, router_pb2_grpc, worker_pb2


def test_the_pool_reports_health_tables_and_limits() -> None:
    pool = WorkerPool()
    changes: list[str] = []
    pool.subscribe(lambda: changes.append("changed"))
    entry = pool.add("w:1")
    described = worker_pb2.DescribeResponse(
        models=[inference_pb2.ModelInfo(name="m", max_context=8)], concurrency_limit=3
    )
    pool.set_health(entry, True, "health SERVING", described)
    assert (entry.healthy, entry.limit, list(entry.models), entry.reason) == (True, 3, ["m"], "health SERVING")
    assert len(changes) == 1
    assert pool.apply(
        router_pb2.WeightTable(
            version=1, workers=[router_pb2.WorkerWeight(address="w:1", weight=0.5, concurrency_limit=2)]
        )
    )
    assert (entry.weight, entry.limit, len(changes)) == (0.5, 2, 2)
    assert not pool.apply(router_pb2.WeightTable(version=1))  # not newer: nothing changed, nobody told
    pool.set_health(entry, False, "unreachable: UNAVAILABLE")
    assert not entry.healthy and len(changes) == 3
    assert entry.reason == ""  # a table is in force: its reason stands (here: none given)


async def test_a_suspension_ends_on_time_and_is_reported() -> None:
    pool = WorkerPool()
    changed = asyncio.Event()
    pool.subscribe(changed.set)
    entry = pool.add("w:1")
    entry.healthy = True
    entry.models = {"m": inference_pb2.ModelInfo(name="m")}
    pool.suspend(entry, 0.2, "stalled")
    assert pool.pick("m") is None
    started = time.monotonic()
    await asyncio.wait_for(changed.wait(), 2)
    assert time.monotonic() - started >= 0.15  # the timer's own clock may run a hair ahead
    assert pool.pick("m") is entry and entry.suspended_reason == ""


async def test_a_failover_waits_for_the_suspension_to_end_then_continues_at_once() -> None:
    """The only live worker fails mid-stream: the stream waits out its suspension and continues on it."""
    async with in_process_mesh(stall_timeout_s=0.5) as mesh:
        down = mesh.workers[1]
        down.servicer.serving = False
        await down.host.set_ready(False)
        await wait_until(lambda: not mesh.router.pool.entries[down.host.address].healthy)
        mesh.backends[0].fail_after = 3
        started = time.monotonic()
        chunks = [
            c
            async for c in mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="p", max_tokens=6), timeout=10)
        ]
        elapsed = time.monotonic() - started
        assert "".join(c.text for c in chunks) == "".join(f"tok{i} " for i in range(6))
        assert chunks[-1].migrations == 1 and len(mesh.backends[0].started) == 2
        # Suspended for the 0.5 s stall window; a poll would add up to its period on top, the timer nothing
        # (the bound is generous for a loaded 2-core machine).
        assert 0.45 <= elapsed < 1.5, elapsed


async def queue_one(mesh: InProcessMesh) -> tuple[list[grpc.aio.UnaryStreamCall], grpc.aio.UnaryStreamCall]:
    """Worker 1 out of routing, worker 0's 4 slots busy, one generation waiting."""
    for backend in mesh.backends:
        backend.delay = 0.05
    running = [
        mesh.inference.Generate(inference_pb2.GenerateRequest(prompt=f"fill{i}", max_tokens=400)) for i in range(4)
    ]
    await asyncio.gather(*(c.read() for c in running))
    waiting = mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="waiting", max_tokens=2))
    await wait_until(lambda: len(mesh.router.admission.waiting) == 1)
    return running, waiting


async def test_a_worker_coming_back_takes_a_waiting_generation(mesh: InProcessMesh) -> None:
    back = mesh.workers[1]
    back.servicer.serving = False
    await back.host.set_ready(False)
    await wait_until(lambda: not mesh.router.pool.entries[back.host.address].healthy)
    running, waiting = await queue_one(mesh)
    try:
        back.servicer.serving = True
        await back.host.set_ready(True)  # the router's health watch sees SERVING
        chunks = await asyncio.wait_for(_read_all(waiting), 2)  # not after the 20 s the others run
        assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
        assert [g.params.prompt for g in mesh.backends[1].started] == ["waiting"]
    finally:
        for call in running:
            call.cancel()


async def test_a_table_raising_a_weight_takes_a_waiting_generation(mesh: InProcessMesh) -> None:
    addresses = [w.host.address for w in mesh.workers]
    control = router_pb2_grpc.ControlStub(mesh.channel).PushWeights(timeout=10)
    await control.write(
        router_pb2.WeightTable(
            version=1,
            workers=[
                router_pb2.WorkerWeight(address=addresses[0], weight=1.0),
                router_pb2.WorkerWeight(address=addresses[1], weight=0.0),
            ],
        )
    )
    await control.read()
    running, waiting = await queue_one(mesh)
    try:
        await control.write(
            router_pb2.WeightTable(
                version=2, workers=[router_pb2.WorkerWeight(address=a, weight=1.0) for a in addresses]
            )
        )
        assert (await control.read()).applied
        chunks = await asyncio.wait_for(_read_all(waiting), 2)
        assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
        assert [g.params.prompt for g in mesh.backends[1].started] == ["waiting"]
    finally:
        for call in running:
            call.cancel()
        control.cancel()


async def test_nothing_re_dispatches_periodically(mesh: InProcessMesh) -> None:
    names = {task.get_name() for task in mesh.router._tasks}
    assert not any("dispatch" in name for name in names), names


async def _read_all(call: grpc.aio.UnaryStreamCall) -> list[inference_pb2.GenerateChunk]:
    return [c async for c in call]
