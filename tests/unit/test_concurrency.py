"""The worker's adaptive concurrency limit: TTFT gradient against the unloaded baseline, memory cap."""

from __future__ import annotations

import asyncio

import grpc

from tokenmesh.prober import Prober, ProberConfig, Scoring, WorkerView, compute_weight
from tokenmesh.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
from tokenmesh.worker import AdaptiveLimit, DeviceReading

from .conftest import InProcessMesh, in_process_mesh, wait_until
from .test_failure_classes import stats


async def collect(mesh: InProcessMesh, request: inference_pb2.GenerateRequest) -> list[inference_pb2.GenerateChunk]:
    return [c async for c in mesh.inference.Generate(request)]

GIB = 1024**3


def feed(limit: AdaptiveLimit, ttft_ms: float, queued: bool, windows: int) -> list[int]:
    values = []
    for _ in range(windows):
        for _ in range(limit.window):
            limit.sample(ttft_ms, queued)
        values.append(limit.value)
    return values


def test_limit_grows_by_one_per_window_while_ttft_stays_near_the_unloaded_baseline() -> None:
    limit = AdaptiveLimit(initial=4, maximum=16)
    values = feed(limit, 100.0, queued=False, windows=30)
    assert values[:4] == [4, 5, 5, 6]  # halfway to limit + 1 each window
    assert values == sorted(values) and values[-1] == 16  # up to the maximum, never past it
    assert limit.baseline_ms == 100.0


def test_limit_falls_when_ttft_tail_is_far_over_the_baseline_and_recovers() -> None:
    limit = AdaptiveLimit(initial=16, maximum=16)
    feed(limit, 100.0, queued=False, windows=1)
    assert limit.value == 16
    falling = feed(limit, 900.0, queued=True, windows=12)  # 9x the baseline: congestion
    assert falling[:3] == [12, 9, 6]  # x0.75 a window: halfway to half
    assert falling[-1] == 1  # down to the minimum
    assert limit.baseline_ms == 100.0  # queued samples never move the baseline
    rising = feed(limit, 150.0, queued=True, windows=10)  # within 2x the baseline: fine
    assert rising == sorted(rising) and rising[-1] == 6


def test_one_slow_sample_in_a_window_is_not_congestion_two_are() -> None:
    limit = AdaptiveLimit(initial=8, maximum=8)
    limit.sample(100.0, queued=False)
    for _ in range(6):
        limit.sample(100.0, queued=False)
    limit.sample(5000.0, queued=True)  # the p90 of 8 samples is the 7th smallest
    assert limit.value == 8
    for ttft in (100.0,) * 6 + (5000.0, 5000.0):
        limit.sample(ttft, queued=ttft > 100)
    assert limit.value < 8


def test_limit_does_not_move_before_an_unloaded_sample() -> None:
    limit = AdaptiveLimit(initial=4, maximum=16)
    feed(limit, 5000.0, queued=True, windows=5)
    assert limit.value == 4 and limit.baseline_ms is None


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
    await call.write(worker_pb2.WorkerCommand(
        start=inference_pb2.GenerateRequest(prompt="p", max_tokens=tokens, request_id=request_id)))
    count = 0
    async for event in call:
        count += event.chunk.token_count
    return count


async def test_worker_limit_follows_engine_queueing_and_reports_tritons_queue_figures() -> None:
    async with in_process_mesh() as mesh:
        worker, backend = mesh.workers[0], mesh.backends[0]
        backend.engine_slots = asyncio.Semaphore(4)
        backend.delay = 0.005
        servicer = worker.servicer
        servicer.telemetry.engine_poll_s = 0.2  # from the next read on
        async with grpc.aio.insecure_channel(worker.host.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            # Waves of 4 fit the engine's slots: the baseline, and the limit stays at the slots.
            for wave in range(4):
                counts = await asyncio.gather(*(generate_direct(stub, f"a{wave}-{i}", 4) for i in range(4)))
                assert counts == [4] * 4
            assert servicer.limits.concurrency_limit(servicer.in_flight) == 4
            assert servicer.limits.adaptive().baseline_ms is not None
            # 16 at once (past the router): 12 wait in the engine's queue for a whole generation
            # (0.8 s: the worker reads the engine's figures every 0.2 s here).
            floods = [asyncio.create_task(generate_direct(stub, f"b{i}", 160)) for i in range(16)]
            await wait_until(lambda: backend.waiting == 12)
            await wait_until(lambda: servicer.telemetry.engine_pending == 12, timeout=2)
            seen = await stats(mesh, 0)
            assert seen.triton_pending == 12
            assert await asyncio.gather(*floods) == [160] * 16
            lowered = servicer.limits.concurrency_limit(servicer.in_flight)
            assert lowered < 4
            telemetry = servicer.telemetry
            await wait_until(lambda: telemetry.engine_queue_ms is not None and telemetry.engine_pending == 0, timeout=2)
            seen = await stats(mesh, 0)
            assert seen.triton_queue_ms > 0 and seen.HasField("ttft_baseline_ms")
            assert seen.concurrency_limit == lowered
            # Unqueued again: the limit climbs back to the slots.
            for wave in range(32):  # 8 windows of 8: +0.5 each
                await asyncio.gather(*(generate_direct(stub, f"c{wave}-{i}", 4) for i in range(2)))
            assert servicer.limits.concurrency_limit(servicer.in_flight) == 4
        # The other worker's engine keeps no queue figures: unset, not zero.
        other = await stats(mesh, 1)
        assert not other.HasField("triton_pending") and not other.HasField("triton_queue_ms")


def test_tritons_pending_queue_lowers_the_weight() -> None:
    view = WorkerView("w", reachable=True, serving=True, stats_at=100.0,
                      stats=worker_pb2.WorkerStats(concurrency_limit=4, in_flight=0, triton_pending=3))
    weight = compute_weight(view, 100.0, Scoring())
    assert weight.weight == 0.25 and "3 waiting in Triton's queue" in weight.reason


async def test_router_never_sends_a_worker_more_than_its_adapted_limit(mesh: InProcessMesh) -> None:
    for backend in mesh.backends:
        backend.delay = 0.02
    for worker in mesh.workers:
        worker.servicer.limits.adaptive()._estimate = 2.0  # as if TTFT had pushed it down to 2
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
