"""Resume: re-attach to a generation after the caller's stream dropped."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.support.fakes import FakeBackend
from tests.support.mesh import InProcessMesh, assert_exact, in_process_mesh, wait_until
from tokenmesh.errors import OutOfRange, ResourceExhausted
from tokenmesh.v1 import inference_pb2, worker_pb2
from tokenmesh.worker import GenerationParams, Record, Registry

pytestmark = pytest.mark.usefixtures("mesh_road")  # down the Link and the per-generation road alike


async def read_n(call, n: int) -> list[inference_pb2.GenerateChunk]:
    return [await call.read() for _ in range(n)]


async def resume(mesh: InProcessMesh, request_id: str, after_seq: int) -> list[inference_pb2.GenerateChunk]:
    request = inference_pb2.ResumeRequest(request_id=request_id, after_seq=after_seq)
    return [c async for c in mesh.inference.Resume(request)]


async def test_resume_after_the_caller_disconnects(mesh: InProcessMesh) -> None:
    for b in mesh.backends:
        b.delay = 0.02
    call = mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="p", max_tokens=30, request_id="r1"))
    first = await read_n(call, 3)
    call.cancel()  # the caller's stream drops, and it resumes at once
    rest = await resume(mesh, "r1", after_seq=3)
    chunks = first + rest
    assert_exact(chunks, 30)
    # The generation was never cancelled on its worker: it went on meanwhile.
    assert not any(g.cancelled.is_set() for b in mesh.backends for g in b.started)


async def test_resume_replays_a_finished_generation_within_the_grace_period(mesh: InProcessMesh) -> None:
    chunks = [
        c
        async for c in mesh.inference.Generate(
            inference_pb2.GenerateRequest(prompt="p", max_tokens=5, request_id="done-1")
        )
    ]
    replay = await resume(mesh, "done-1", after_seq=2)
    assert [(c.seq, c.text) for c in replay] == [(c.seq, c.text) for c in chunks[2:]]
    assert replay[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH


async def test_resume_errors(mesh: InProcessMesh) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await resume(mesh, "never-started", after_seq=0)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "resume grace period" in info.value.details()
    chunks = [
        c
        async for c in mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="p", max_tokens=5, request_id="r2"))
    ]
    last = chunks[-1].seq  # 6 unless unread tokens merged into one chunk on a loaded machine
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await resume(mesh, "r2", after_seq=99)
    assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert f"beyond the last seq sent, {last}" in info.value.details()
    # After the final chunk: at once a precise answer that nothing follows, no stream and no retry.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await resume(mesh, "r2", after_seq=last)
    assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert f"generation r2 ended at seq {last}: nothing comes after it" in info.value.details()
    assert [c.seq for c in await resume(mesh, "r2", after_seq=last - 1)] == [last]


async def test_resume_after_the_grace_period_is_not_found() -> None:
    async with in_process_mesh(worker_settings={"resume_grace_s": 0.2}) as mesh:
        [
            c
            async for c in mesh.inference.Generate(
                inference_pb2.GenerateRequest(prompt="p", max_tokens=3, request_id="old")
            )
        ]
        # The workers drop it once the 0.2 s grace period is over (their collector looks every 0.05 s).
        await wait_until(lambda: all("old" not in w.servicer.registry.records for w in mesh.workers), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await resume(mesh, "old", after_seq=0)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_detached_generation_stops_after_the_grace_period() -> None:
    async with in_process_mesh(worker_settings={"resume_grace_s": 0.3}) as mesh:
        for b in mesh.backends:
            b.delay = 0.05
        call = mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="p", max_tokens=400, request_id="d"))
        await read_n(call, 2)
        call.cancel()
        generation = next(g for b in mesh.backends for g in b.started)
        await asyncio.wait_for(generation.cancelled.wait(), 3)  # nobody re-attached in time
        await wait_until(lambda: all(w.servicer.in_flight == 0 for w in mesh.workers))


async def test_cancel_reaches_a_detached_generation(mesh: InProcessMesh) -> None:
    for b in mesh.backends:
        b.delay = 0.05
    call = mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="p", max_tokens=400, request_id="c"))
    await read_n(call, 2)
    call.cancel()
    await wait_until(lambda: "c" not in mesh.router.inference.live.by_id)
    response = await mesh.inference.Cancel(inference_pb2.CancelRequest(request_id="c"))
    assert response.cancelled
    generation = next(g for b in mesh.backends for g in b.started)
    await asyncio.wait_for(generation.cancelled.wait(), 2)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await resume(mesh, "c", after_seq=2)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_replay_buffer_is_bounded_and_says_what_was_dropped() -> None:
    backend = FakeBackend(delay=0)
    settled = []
    registry = Registry(grace_s=30, max_bytes=200, on_settled=settled.append)
    record = registry.start("b", 1, 0, backend.generate(GenerationParams(model="fake", prompt="p", max_tokens=100)))
    await asyncio.wait_for(record.task, 5)
    assert record.bytes <= 200 and record.evicted > 0 and settled == [record]
    with pytest.raises(OutOfRange, match="no longer kept"):
        [e async for e in record.stream(0)]
    tail = [e async for e in record.stream(record.first_seq + record.evicted - 1)]
    assert tail[-1].WhichOneof("event") == "end" and tail[-1].seq == record.total
    assert record.total < 101  # nobody read: 100 chunks merged into fewer, each under 200/8 bytes
    assert all(e.chunk.ByteSize() <= 25 for e in tail if e.HasField("chunk"))
    await registry.close()


def chunk(text: str) -> worker_pb2.WorkerEvent:
    return worker_pb2.WorkerEvent(chunk=worker_pb2.TokenChunk(text=text, token_count=1))


async def test_unread_chunks_merge_read_ones_never_change_and_a_stopped_reader_overflows() -> None:
    backend = FakeBackend()
    record = Record("m", 1, 0, backend.generate(GenerationParams(model="fake", prompt="p")), max_bytes=4096)
    reader = record.stream(0)
    record.append(chunk("a "))
    first = await anext(reader)
    assert (first.seq, first.chunk.text) == (1, "a ")
    for text in ("b ", "c ", "d "):  # the reader is busy (e.g. its gRPC write waits)
        record.append(chunk(text))
    assert record.total == 2  # b, c and d merged into one unread chunk
    assert (first.chunk.text, first.chunk.token_count) == ("a ", 1)  # what was read never changes
    second = await anext(reader)
    assert (second.seq, second.chunk.text, second.chunk.token_count) == (2, "b c d ", 3)
    # A resume from seq 1 sees exactly what the live reader saw.
    replay = record.stream(1)
    assert (await anext(replay)).chunk.text == "b c d "
    await replay.aclose()
    # A reader that stops: merged chunks stay under 4096/8 bytes, so the buffer overflows for it.
    for i in range(800):
        record.append(chunk(f"token{i:04d} "))
    assert max(e.ByteSize() for e in record.events) <= 4096 // 8 and record.evicted > 2
    with pytest.raises(ResourceExhausted, match="reader too slow"):
        await anext(reader)
