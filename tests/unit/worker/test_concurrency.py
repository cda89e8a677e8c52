"""The worker's concurrency limit: lowered by the engine's own queue and device memory, never by TTFT."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc

from tests.support.mesh import InProcessMesh, in_process_mesh, stats, wait_until
from tokenmesh.prober import Prober, ProberConfig, Scoring, WorkerView, compute_weight
from tokenmesh.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
from tokenmesh.worker import AdaptiveLimit, DeviceReading


async def collect(mesh: InProcessMesh, request: inference_pb2.GenerateRequest) -> list[inference_pb2.GenerateChunk]:
    return [c async for c in mesh.inference.Generate(request)]


GIB = 1024**3


def poll(limit: AdaptiveLimit, pending: int | None, in_flight: int, times: int) -> list[int]:
    values = []
    for _ in range(times):
        limit.observe_engine(pending, in_flight)
        values.append(limit.value)
    return values


def test_batching_driven_ttft_growth_does_not_lower_the_limit() -> None:
    limit = AdaptiveLimit(initial=64, maximum=64)
    for _ in range(8):
        limit.sample(50.0, queued=False)  # unloaded: the baseline
    # A batching engine: every generation it adds makes TTFT longer, 40x the baseline at the end,
    # and its own queue stays empty (it takes everything it is given).
    for in_flight in range(1, 65):
        for _ in range(8):
            limit.sample(50.0 * (1 + in_flight * 0.6), queued=False)
        limit.observe_engine(0, in_flight)
    assert limit.value == 64 and limit.limit(in_flight=64) == 64
    assert limit.baseline_ms is not None and limit.baseline_ms > 50.0  # reported, but it moves nothing


def test_a_growing_triton_queue_lowers_the_limit_to_what_the_engine_runs() -> None:
    limit = AdaptiveLimit(initial=16, maximum=16)
    assert poll(limit, 4, in_flight=16, times=2) == [16, 16]  # a burst in Triton's queue is not saturation
    assert poll(limit, 0, in_flight=16, times=1) == [16]  # and it drained
    assert poll(limit, 4, in_flight=16, times=3) == [16, 16, 12]  # a queue that stays: the engine runs 12
    assert poll(limit, 9, in_flight=12, times=3) == [12, 12, 3]  # it keeps growing: down to what runs
    assert poll(limit, 20, in_flight=12, times=3)[-1] == 1  # never below the minimum


def test_the_limit_climbs_back_one_per_quiet_poll_up_to_the_slots() -> None:
    limit = AdaptiveLimit(initial=8, maximum=8)
    poll(limit, 6, in_flight=8, times=3)
    assert limit.value == 2
    assert poll(limit, 0, in_flight=2, times=7) == [3, 4, 5, 6, 7, 8, 8]


def test_an_engine_that_reports_no_queue_never_lowers_the_limit() -> None:
    limit = AdaptiveLimit(initial=8, maximum=8)
    assert poll(limit, None, in_flight=30, times=10) == [8] * 10


def test_memory_over_the_threshold_adds_nothing_to_what_runs() -> None:
    limit = AdaptiveLimit(initial=8, maximum=16)
    hot = [DeviceReading(0, "NVIDIA H200", 135 * GIB, 140 * GIB, 90)]  # 96% > 92%
    assert limit.limit(in_flight=3, devices=hot) == 3
    assert limit.limit(in_flight=0, devices=hot) == 1  # never below the minimum
    assert limit.limit(in_flight=3, devices=()) == 8  # no GPU: no memory cap


def test_memory_headroom_caps_the_limit_at_the_generations_it_holds() -> None:
    limit = AdaptiveLimit(initial=16, maximum=16)
    total = 100 * GIB
    assert limit.limit(0, [DeviceReading(0, "gpu", 40 * GIB, total, 0)]) == 16  # idle: 40 GiB is the model
    # 4 generations use 40 GiB more: 10 GiB each; 92 - 80 = 12 GiB more holds one more.
    assert limit.limit(4, [DeviceReading(0, "gpu", 80 * GIB, total, 50)]) == 5
    assert limit.limit(2, [DeviceReading(0, "gpu", 50 * GIB, total, 50)]) == 10  # 5 GiB each: 2 + 42/5 -> 10


async def generate_direct(stub: worker_pb2_grpc.WorkerStub, request_id: str, tokens: int) -> int:
    call = stub.Generate()
    await call.write(
        worker_pb2.WorkerCommand(
            start=inference_pb2.GenerateRequest(prompt="p", max_tokens=tokens, request_id=request_id)
        )
    )
    count = 0
    async for event in call:
        count += event.chunk.token_count
    return count


async def test_worker_limit_follows_the_engines_own_queue_not_its_ttft() -> None:
    async with in_process_mesh() as mesh:
        worker, backend = mesh.workers[0], mesh.backends[0]
        backend.engine_slots = asyncio.Semaphore(4)
        backend.delay = 0.005
        servicer = worker.servicer
        servicer.telemetry.engine_poll_s = 0.1  # from the next read on
        async with grpc.aio.insecure_channel(worker.host.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            # Waves of 4 fit the engine's slots: the baseline, and the limit stays at the slots.
            for wave in range(4):
                counts = await asyncio.gather(*(generate_direct(stub, f"a{wave}-{i}", 4) for i in range(4)))
                assert counts == [4] * 4
            assert servicer.limits.concurrency_limit(servicer.in_flight) == 4
            assert servicer.limits.adaptive().baseline_ms is not None
            # The engine now runs only 2 of its 4 slots (as one short of memory does): 4 sent, 2 wait
            # in its queue for whole generations (1.6 s; the worker reads its figures every 0.1 s).
            backend.engine_slots = asyncio.Semaphore(2)
            floods = [asyncio.create_task(generate_direct(stub, f"b{i}", 320)) for i in range(4)]
            await wait_until(lambda: servicer.telemetry.engine_pending == 2, timeout=2)
            seen = await stats(mesh, 0)
            assert seen.triton_pending == 2
            await wait_until(lambda: servicer.limits.concurrency_limit(servicer.in_flight) == 2, timeout=2)
            assert await asyncio.gather(*floods) == [320] * 4
            telemetry = servicer.telemetry
            await wait_until(lambda: telemetry.engine_queue_ms is not None and telemetry.engine_pending == 0, timeout=2)
            seen = await stats(mesh, 0)
            assert seen.triton_queue_ms > 0 and seen.HasField("ttft_baseline_ms")
            # The queue is empty again: the limit climbs back to the slots, one per read.
            await wait_until(lambda: servicer.limits.concurrency_limit(servicer.in_flight) == 4, timeout=2)
        # The other worker's engine keeps no queue figures: unset, not zero.
        other = await stats(mesh, 1)
        assert not other.HasField("triton_pending") and not other.HasField("triton_queue_ms")


def test_tritons_pending_queue_lowers_the_weight() -> None:
    view = WorkerView(
        "w",
        reachable=True,
        serving=True,
        stats_at=100.0,
        stats=worker_pb2.WorkerStats(concurrency_limit=4, in_flight=0, triton_pending=3),
    )
    weight = compute_weight(view, 100.0, Scoring())
    assert weight.weight == 0.25 and "3 waiting in Triton's queue" in weight.reason


async def test_router_never_sends_a_worker_more_than_its_adapted_limit(mesh: InProcessMesh) -> None:
    for backend in mesh.backends:
        backend.delay = 0.02
    for backend in mesh.backends:
        backend._spec = dataclasses.replace(backend._spec, slots=2)  # an engine of 2 slots: the limit follows them
    addresses = tuple(w.host.address for w in mesh.workers)
    prober = Prober(ProberConfig(port=0, workers=addresses, routers=(mesh.router.host.address,), interval_s=0.05))
    await prober.start()
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, *(w.servicer.in_flight for w in mesh.workers))
            await asyncio.sleep(0.002)

    watcher = asyncio.create_task(watch())
    try:
        pool = mesh.router.pool
        await wait_until(lambda: all(e.limit == 2 for e in pool.entries.values()), timeout=3)
        requests = [inference_pb2.GenerateRequest(prompt="p", max_tokens=10, request_id=f"r{i}") for i in range(10)]
        results = await asyncio.gather(*(collect(mesh, r) for r in requests))
    finally:
        watcher.cancel()
        await prober.shutdown()
    assert [chunks[-1].finish_reason for chunks in results] == [inference_pb2.FINISH_REASON_LENGTH] * 10
    assert peak == 2
