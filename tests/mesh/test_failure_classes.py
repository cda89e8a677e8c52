"""Each failure class and the action the worker and router take (in-memory backend)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.support.mesh import InProcessMesh, collect, in_process_mesh, stats, wait_until
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, router_pb2, worker_pb2, worker_pb2_grpc
from tokenmesh.worker import BackendError

pytestmark = pytest.mark.usefixtures("mesh_road")  # down the Link and the per-generation road alike


async def test_device_oom_lowers_the_limit_and_the_request_runs_elsewhere(mesh: InProcessMesh) -> None:
    mesh.backends[0].fault_once = (worker_pb2.ERROR_CLASS_OUT_OF_MEMORY, "CUDA out of memory. Tried to allocate 2 GiB")
    chunks = await collect(mesh, prompt="p", max_tokens=3)
    assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert len(mesh.backends[1].started) == 1  # retried on the other worker
    s0, s1 = await stats(mesh, 0), await stats(mesh, 1)
    assert (s0.oom_total, s0.concurrency_limit, s0.serving) == (1, 1, True)
    assert (s1.oom_total, s1.concurrency_limit) == (0, 4)
    # The latency signals the prober weighs: set once a generation ran, unset before.
    assert s1.HasField("ttft_ms") and s1.HasField("itl_ms") and s1.itl_ms > 0
    # The lowered limit is enforced: a second generation at once is refused there.
    servicer = mesh.workers[0].servicer
    assert servicer.limits.admission_limit() == 1


async def test_shedding_after_oom_sends_waiting_work_elsewhere(mesh: InProcessMesh) -> None:
    backend = mesh.backends[0]
    backend.delay = 0.2  # generations sit before their first token
    servicer = mesh.workers[0].servicer
    async with grpc.aio.insecure_channel(mesh.workers[0].host.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        calls = []
        for i in range(3):
            call = stub.Generate()
            await call.write(
                worker_pb2.WorkerCommand(
                    start=inference_pb2.GenerateRequest(prompt="p", max_tokens=5, request_id=f"w{i}")
                )
            )
            calls.append(call)
        await wait_until(lambda: servicer.in_flight == 3)
        record = servicer.registry.records["w0"]
        servicer._failed(record, BackendError(worker_pb2.ERROR_CLASS_OUT_OF_MEMORY, "CUDA out of memory"))
        events = [await calls[i].read() for i in (1, 2)]
        assert all(e.WhichOneof("event") == "error" for e in events)
        assert all(
            e.error.error_class == worker_pb2.ERROR_CLASS_UNAVAILABLE and "shed" in e.error.message for e in events
        )
        for call in calls:
            call.cancel()


async def test_lost_device_restarts_the_backend_before_serving_again(mesh: InProcessMesh) -> None:
    mesh.backends[0].fault_once = (
        worker_pb2.ERROR_CLASS_DEVICE_LOST,
        "CUDA error: an illegal memory access was encountered",
    )
    chunks = await collect(mesh, prompt="p", max_tokens=3)
    assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH  # ran on the other worker
    await wait_until(lambda: mesh.backends[0].restarts == 1)
    await wait_until(lambda: mesh.workers[0].servicer.serving)
    s0 = await stats(mesh, 0)
    assert s0.backend_restarts == 1 and s0.state_reason == "serving"
    # The probe generation ran on the restarted backend before it served again.
    assert mesh.backends[0].started[-1].params.prompt == "Hello"


async def test_caller_errors_never_count_against_a_worker(mesh: InProcessMesh) -> None:
    for _ in range(5):
        with pytest.raises(grpc.aio.AioRpcError):
            await collect(mesh, prompt="fail-invalid")
    table = await mesh.operator.GetRoutingTable(router_pb2.GetRoutingTableRequest())
    assert all(w.weight == 1.0 and "avoided" not in w.reason for w in table.workers)
    assert [(await stats(mesh, i)).oom_total for i in (0, 1)] == [0, 0]
    assert all(b.restarts == 0 for b in mesh.backends)


async def test_slow_reader_gets_resource_exhausted() -> None:
    async with in_process_mesh(
        worker_settings={"replay_buffer_bytes": 4096}, backend_settings={"max_context": 32768}
    ) as mesh:
        for b in mesh.backends:
            b.delay = 0
        # ~170 KB of text, far more than the HTTP/2 windows on the way hold (the caller's is
        # kept small, as on a slow link); unread chunks merge, but a merged chunk stays under
        # 1/8 of the replay buffer, so the buffer still overflows for a reader that stops.
        options = (("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 4096))
        async with grpc.aio.insecure_channel(mesh.router.host.address, options=options) as channel:
            call = inference_pb2_grpc.InferenceStub(channel).Generate(
                inference_pb2.GenerateRequest(prompt="p" * 10, max_tokens=20000)
            )
            await call.read()
            await asyncio.sleep(1.0)  # the caller stops reading while the worker generates
            with pytest.raises(grpc.aio.AioRpcError) as info:
                while await call.read() is not grpc.aio.EOF:
                    pass
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "too slow" in info.value.details()
