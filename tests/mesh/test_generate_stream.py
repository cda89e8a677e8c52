"""Inference/GenerateStream: many generations on one call, each exactly as its own Generate or Resume call.

Driven with the raw generated stub, so every message, credit grant and end is the test's own.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from tests.support.dns_server import free_port_on
from tests.support.fakes import FakeBackend
from tests.support.mesh import InProcessMesh, assert_exact, expected_text, in_process_mesh, wait_until
from tests.support.tcp_proxy import TcpProxy
from tokenmesh.errors import ResourceExhausted, from_status
from tokenmesh.router import Router, RouterConfig
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc
from tokenmesh.worker import Worker, WorkerConfig

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]


class Caller:
    """One GenerateStream call: what each stream received (its chunks, or the status it ended with), by id."""

    def __init__(self, mesh: InProcessMesh, **call: Any) -> None:
        self.call = inference_pb2_grpc.InferenceStub(mesh.channel).GenerateStream(**call)
        self.chunks: dict[int, list[inference_pb2.GenerateChunk]] = defaultdict(list)
        self.ends: dict[int, status_pb2.Status] = {}
        self.finished: set[int] = set()
        self.messages = 0
        """Messages after the settings."""
        self.settings = inference_pb2.StreamSettings()

    async def open(self) -> inference_pb2.StreamSettings:
        first = await self.call.read()
        assert first.HasField("settings") and not first.chunks
        self.settings = first.settings
        return self.settings

    async def send(self, *commands: inference_pb2.StreamCommand, credit: dict[int, int] | None = None) -> None:
        message = inference_pb2.StreamCommands(commands=commands)
        for stream, size in (credit or {}).items():
            message.credit_stream.append(stream)
            message.credit_bytes.append(size)
        await self.call.write(message)

    async def read(self) -> bool:
        """One message into chunks and ends (False at the call's end)."""
        message = await self.call.read()
        if message is grpc.aio.EOF:
            return False
        self.messages += 1
        assert len(message.chunk_stream) == len(message.chunks)
        for stream, piece in zip(message.chunk_stream, message.chunks, strict=True):
            assert stream not in self.finished, f"stream {stream} got a chunk after its end"
            self.chunks[stream].append(piece)
            if piece.finish_reason:
                self.finished.add(stream)
        for end in message.ends:
            assert end.stream not in self.finished, f"stream {end.stream} ended twice"
            assert end.status.code != 0
            self.ends[end.stream] = end.status
            self.finished.add(end.stream)
        return True

    async def until(self, *streams: int, timeout: float = 20) -> None:
        """Read until every one of streams has ended."""

        async def loop() -> None:
            while not set(streams) <= self.finished:
                assert await self.read(), f"the call ended before streams {set(streams) - self.finished}"

        await asyncio.wait_for(loop(), timeout)

    async def rest(self, timeout: float = 20) -> None:
        """Read to the call's end."""

        async def loop() -> None:
            while await self.read():
                pass

        await asyncio.wait_for(loop(), timeout)


def generate(stream: int, **fields: Any) -> inference_pb2.StreamCommand:
    options = {k: fields.pop(k) for k in ("timeout_s", "window_bytes", "metadata") if k in fields}
    return inference_pb2.StreamCommand(stream=stream, generate=inference_pb2.GenerateRequest(**fields), **options)


def resume(stream: int, request_id: str, after_seq: int) -> inference_pb2.StreamCommand:
    return inference_pb2.StreamCommand(
        stream=stream, resume=inference_pb2.ResumeRequest(request_id=request_id, after_seq=after_seq)
    )


def cancel(stream: int) -> inference_pb2.StreamCommand:
    return inference_pb2.StreamCommand(stream=stream, cancel=inference_pb2.StreamCancel())


def detach(stream: int) -> inference_pb2.StreamCommand:
    return inference_pb2.StreamCommand(stream=stream, detach=inference_pb2.StreamDetach())


def bad_request(status: status_pb2.Status) -> list[tuple[str, str]]:
    """The field violations of a status's BadRequest detail."""
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            found = error_details_pb2.BadRequest()
            detail.Unpack(found)
            return [(v.field, v.description) for v in found.field_violations]
    return []


def reason(status: status_pb2.Status) -> str:
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info.reason
    return ""


async def test_dozens_of_generations_on_one_call_each_exact_and_batched() -> None:
    async with in_process_mesh(metrics_port=free_port_on("127.0.0.1")) as mesh:
        for backend in mesh.backends:
            backend.delay = 0  # the engines produce faster than one message per chunk could carry
        caller = Caller(mesh)
        try:
            settings = await caller.open()
            assert (settings.protocol, settings.default_window_bytes) == (1, 64 * 1024)
            # At most as many streams as the caller's connection may open Generate calls (the router's setting).
            limit = mesh.router.config.max_streams_per_connection
            assert (settings.max_batch_bytes, settings.max_streams) == (256 * 1024, limit)
            streams = range(1, 41)
            await caller.send(*(generate(s, prompt=f"p{s}", max_tokens=20) for s in streams))
            await caller.call.done_writing()  # half-closed: every stream is sent on to its end, then the call ends
            await caller.rest()
            assert await caller.call.code() == grpc.StatusCode.OK
        finally:
            caller.call.cancel()
        sample = mesh.router.metrics.registry.get_sample_value
        counted = (sample("tokenmesh_router_stream_messages_total"), sample("tokenmesh_router_stream_chunks_total"))
        assert sum(len(b.started) for b in mesh.backends) == 40
    assert caller.ends == {}
    for s in streams:
        assert_exact(caller.chunks[s], 20)
        assert {c.request_id for c in caller.chunks[s]} == {caller.chunks[s][0].request_id}
    assert len({caller.chunks[s][0].request_id for s in streams}) == 40
    chunks = sum(len(caller.chunks[s]) for s in streams)
    # Batched: what became ready while a message was being written left together in the next one.
    assert caller.messages < chunks / 2, (caller.messages, chunks)
    assert counted == (caller.messages, chunks)


async def test_a_bad_request_ends_its_own_stream_with_the_calls_status_and_details(mesh: InProcessMesh) -> None:
    for backend in mesh.backends:
        backend.delay = 0.005
    caller = Caller(mesh)
    try:
        await caller.open()
        await caller.send(
            generate(1, prompt="a", max_tokens=30),
            generate(2, prompt="b", temperature=-0.5),
            generate(3, prompt="c", model="nope"),
            generate(4, prompt="d", max_tokens=30),
        )
        await caller.until(1, 2, 3, 4)
    finally:
        caller.call.cancel()
    assert set(caller.ends) == {2, 3}
    invalid, unknown = caller.ends[2], caller.ends[3]
    assert invalid.code == INVALID and invalid.message == "temperature must be >= 0, got -0.5"
    assert bad_request(invalid) == [("temperature", "temperature must be >= 0, got -0.5")]
    assert unknown.code == grpc.StatusCode.NOT_FOUND.value[0] and "unknown model 'nope'" in unknown.message
    assert (caller.chunks[2], caller.chunks[3]) == ([], [])
    assert_exact(caller.chunks[1], 30)
    assert_exact(caller.chunks[4], 30)


async def test_stream_ids_must_increase_and_a_reused_one_ends_with_invalid_argument(mesh: InProcessMesh) -> None:
    for backend in mesh.backends:
        backend.delay = 0.01
    caller = Caller(mesh)
    try:
        await caller.open()
        await caller.send(generate(4, prompt="a", max_tokens=200))
        await wait_until(lambda: any(b.started for b in mesh.backends))
        await caller.send(generate(4, prompt="again", max_tokens=3), generate(2, prompt="b"), generate(0, prompt="c"))
        await caller.until(4, 2, 0)
        await caller.send(generate(5, prompt="d", max_tokens=5))
        await caller.until(5)
    finally:
        caller.call.cancel()
    assert sorted(caller.ends) == [0, 2, 4]
    for stream, status in caller.ends.items():
        assert status.code == INVALID
        assert f"commands.stream {stream} is not above 4: stream ids are > 0 and increase" in status.message
        assert [field for field, _ in bad_request(status)] == ["commands.stream"]
    # The live stream the reused id named was let go of (its generation cancelled: it has no caller-given id).
    await wait_until(
        lambda: all(g.cancelled.is_set() for b in mesh.backends for g in b.started if g.params.max_tokens == 200)
    )
    assert_exact(caller.chunks[5], 5)


async def test_cancel_ends_a_stream_with_a_final_cancelled_chunk_and_unknown_ids_are_ignored(
    mesh: InProcessMesh,
) -> None:
    for backend in mesh.backends:
        backend.delay = 0.01
    caller = Caller(mesh)
    try:
        await caller.open()
        await caller.send(generate(1, prompt="a", max_tokens=400), generate(2, prompt="b", max_tokens=20))
        while len(caller.chunks[1]) < 3:
            assert await caller.read()
        await caller.send(cancel(1), cancel(99), detach(98))  # 99 and 98 never existed: nothing happens
        await caller.until(1, 2)
        # One cancelled before it could even be admitted: in the same message as its start.
        await caller.send(generate(3, prompt="c", max_tokens=400), cancel(3))
        await caller.until(3)
    finally:
        caller.call.cancel()
    assert caller.ends == {}
    first = caller.chunks[1]
    assert [c.seq for c in first] == list(range(1, len(first) + 1))
    assert first[-1].finish_reason == inference_pb2.FINISH_REASON_CANCELLED
    assert len(first) < 100
    assert_exact(caller.chunks[2], 20)
    assert caller.chunks[3][-1].finish_reason == inference_pb2.FINISH_REASON_CANCELLED
    assert len(caller.chunks[3]) < 50
    cancelled = [g for b in mesh.backends for g in b.started if g.params.max_tokens == 400]
    assert cancelled
    await wait_until(lambda: all(g.cancelled.is_set() for g in cancelled))  # each stopped on its worker


async def test_detach_leaves_a_generation_with_its_own_id_running_and_resume_on_the_same_call_continues_it(
    mesh: InProcessMesh,
) -> None:
    for backend in mesh.backends:
        backend.delay = 0.02
    caller = Caller(mesh)
    try:
        await caller.open()
        await caller.send(generate(1, prompt="p", max_tokens=30, request_id="gs-r1"))
        while len(caller.chunks[1]) < 3:
            assert await caller.read()
        seen = len(caller.chunks[1])
        await caller.send(detach(1), resume(2, "gs-r1", after_seq=seen))
        await caller.until(2)
    finally:
        caller.call.cancel()
    assert 1 not in caller.finished and 1 not in caller.ends  # nothing ends a detached stream
    chunks = caller.chunks[1][:seen] + caller.chunks[2]
    assert_exact(chunks, 30)
    assert not any(g.cancelled.is_set() for b in mesh.backends for g in b.started)  # it ran on meanwhile
    assert sum(len(b.started) for b in mesh.backends) == 1


async def test_a_streams_own_deadline_ends_it_with_deadline_exceeded_and_no_other(mesh: InProcessMesh) -> None:
    for backend in mesh.backends:
        backend.delay = 0.02
    caller = Caller(mesh)
    try:
        await caller.open()
        await caller.send(
            generate(1, prompt="slow", max_tokens=400, timeout_s=0.3), generate(2, prompt="b", max_tokens=20)
        )
        await caller.until(1, 2)
    finally:
        caller.call.cancel()
    assert list(caller.ends) == [1]
    assert caller.ends[1].code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert 0 < len(caller.chunks[1]) < 100
    assert_exact(caller.chunks[2], 20)
    # The worker was told the deadline, and the generation stops there (nobody can resume it).
    slow = next(g for b in mesh.backends for g in b.started if g.params.max_tokens == 400)
    await asyncio.wait_for(slow.cancelled.wait(), 5)


async def test_a_stream_without_credit_holds_no_other_back_and_gets_the_rest_when_credit_comes() -> None:
    async with in_process_mesh(backend_settings={"max_context": 4096}) as mesh:
        caller = Caller(mesh)
        try:
            await caller.open()
            await caller.send(
                generate(1, prompt="slow reader", max_tokens=1000, window_bytes=100),
                generate(2, prompt="b", max_tokens=50),
            )
            await caller.until(2)
            await asyncio.sleep(0.5)  # long enough for the slow stream's 1,000 tokens at the engine
            held = list(caller.chunks[1])
            # 100 bytes of credit: a few chunks of ~22 bytes, then nothing until the caller returns some.
            assert 1 <= len(held) <= 5 and 1 not in caller.finished
            await caller.send(credit={1: 1 << 20})
            await caller.until(1)
        finally:
            caller.call.cancel()
    assert caller.ends == {}
    assert_exact(caller.chunks[2], 50)
    assert_exact(caller.chunks[1], 1000)
    # The worker merged what the router did not read meanwhile: backpressure reached it, not only the router.
    assert max(c.token_count for c in caller.chunks[1]) > 1


async def test_streams_fail_over_mid_stream_with_contiguous_seq(mesh: InProcessMesh) -> None:
    mesh.backends[0].fail_after = 4  # every generation on the first worker fails after 4 tokens
    caller = Caller(mesh)
    try:
        await caller.open()
        await caller.send(*(generate(s, prompt="hello", max_tokens=12, seed=s) for s in range(1, 7)))
        await caller.until(*range(1, 7))
    finally:
        caller.call.cancel()
    assert caller.ends == {}
    for s in range(1, 7):
        assert_exact(caller.chunks[s], 12)
    assert mesh.backends[0].started
    assert sum(caller.chunks[s][-1].migrations for s in range(1, 7)) >= 1


async def test_a_draining_router_refuses_new_streams_finishes_live_ones_then_ends_the_call(
    mesh: InProcessMesh,
) -> None:
    for backend in mesh.backends:
        backend.delay = 0.01
    caller = Caller(mesh)
    shutdown: asyncio.Task[None] | None = None
    try:
        await caller.open()
        await caller.send(*(generate(s, prompt=f"p{s}", max_tokens=40) for s in (1, 2, 3)))
        while not all(caller.chunks[s] for s in (1, 2, 3)):
            assert await caller.read()
        shutdown = asyncio.create_task(mesh.router.shutdown())
        await wait_until(lambda: mesh.router.inference.live.draining)
        await caller.send(generate(4, prompt="late", max_tokens=5))
        await caller.until(1, 2, 3, 4)
        assert not shutdown.done()  # the drain waits for the call's streams
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await caller.rest()
        await asyncio.wait_for(shutdown, 10)
    finally:
        caller.call.cancel()
        if shutdown is not None:
            await asyncio.wait_for(shutdown, 10)
    assert caller.ends[4].code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert reason(caller.ends[4]) == "ROUTER_DRAINING"
    for s in (1, 2, 3):
        assert_exact(caller.chunks[s], 40)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in (info.value.details() or "")


async def test_half_close_sends_every_stream_to_its_end_whatever_its_credit(mesh: InProcessMesh) -> None:
    caller = Caller(mesh)
    try:
        await caller.open()
        await caller.send(
            generate(1, prompt="a", max_tokens=60, window_bytes=40), generate(2, prompt="b", max_tokens=10)
        )
        await caller.call.done_writing()  # no credit can come back now: the router stops counting it
        await caller.rest()
        assert await caller.call.code() == grpc.StatusCode.OK
    finally:
        caller.call.cancel()
    assert_exact(caller.chunks[1], 60)
    assert_exact(caller.chunks[2], 10)


async def test_a_call_that_breaks_stops_every_generation_without_an_id_of_its_own(mesh: InProcessMesh) -> None:
    for backend in mesh.backends:
        backend.delay = 0.01
    caller = Caller(mesh)
    await caller.open()
    await caller.send(
        generate(1, prompt="a", max_tokens=400),
        generate(2, prompt="b", max_tokens=400),
        generate(3, prompt="c", max_tokens=100, request_id="gs-keep"),
    )
    while not all(caller.chunks[s] for s in (1, 2, 3)):
        assert await caller.read()
    caller.call.cancel()
    inference = mesh.router.inference
    await wait_until(
        lambda: not inference.live.by_id and inference.live.open_streams == 0 and inference.live.idle.is_set()
    )
    started = {g.params.request_id: g for b in mesh.backends for g in b.started}
    await wait_until(lambda: all(g.cancelled.is_set() for rid, g in started.items() if rid != "gs-keep"))
    assert not started["gs-keep"].cancelled.is_set()  # runs on for Resume
    rest = [c async for c in mesh.inference.Resume(inference_pb2.ResumeRequest(request_id="gs-keep", after_seq=1))]
    assert rest[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert "".join(c.text for c in [caller.chunks[3][0], *rest]) == expected_text(100)


async def test_a_full_queue_ends_the_stream_with_the_calls_retry_info_and_error_info() -> None:
    async with in_process_mesh(max_queue=1) as mesh:
        for backend in mesh.backends:
            backend.delay = 0.05
        caller = Caller(mesh)
        try:
            await caller.open()
            await caller.send(*(generate(s, prompt=f"fill{s}", max_tokens=400) for s in range(1, 9)))
            while not all(caller.chunks[s] for s in range(1, 9)):  # every slot of both workers taken
                assert await caller.read()
            await caller.send(generate(9, prompt="waits", max_tokens=2))
            await wait_until(lambda: len(mesh.router.admission.waiting) == 1)
            await caller.send(generate(10, prompt="refused", max_tokens=2))
            await caller.until(10)
        finally:
            caller.call.cancel()
    assert list(caller.ends) == [10]
    error = from_status(caller.ends[10])
    assert type(error) is ResourceExhausted and error.reason == "QUEUE_FULL" and error.answered
    assert error.metadata == {"model": "fake", "waiting": "1"}
    assert error.retry_delay is not None and error.retry_delay > 0
    assert f"retry in about {round(error.retry_delay * 1000)} ms" in error.message


async def test_a_cut_worker_connection_fails_every_stream_on_it_over_with_contiguous_seq(mesh_road: str) -> None:
    backends = [FakeBackend(delay=0.02), FakeBackend(delay=0.02)]
    workers = [Worker(WorkerConfig(port=0, drain_grace_s=1), backend=b) for b in backends]
    proxy: TcpProxy | None = None
    router: Router | None = None
    try:
        for w in workers:
            await w.start()
        proxy = TcpProxy("127.0.0.1", workers[0].host.port)
        await proxy.start()
        link = mesh_road
        router = Router(
            RouterConfig(port=0, workers=(proxy.address, workers[1].host.address), drain_grace_s=1, worker_link=link)
        )
        await router.start()
        pool = router.pool
        await wait_until(lambda: all(e.healthy and e.models for e in pool.entries.values()))
        if link == "auto":
            await wait_until(lambda: len(router.transports.modes) == 2)
        async with grpc.aio.insecure_channel(router.host.address) as channel:
            mesh = InProcessMesh(router, workers, backends, channel)
            caller = Caller(mesh)
            await caller.open()
            await caller.send(*(generate(s, prompt=f"p{s}", max_tokens=40) for s in range(1, 7)))
            while not all(len(caller.chunks[s]) >= 3 for s in range(1, 7)):
                assert await caller.read()
            on_proxy = [g for g in backends[0].started if g.params.max_tokens == 40]
            assert on_proxy, "some streams should run on the proxied worker"
            proxy.cut()
            await caller.until(*range(1, 7))
            caller.call.cancel()
        assert caller.ends == {}
        for s in range(1, 7):
            assert_exact(caller.chunks[s], 40)
        assert sum(caller.chunks[s][-1].migrations for s in range(1, 7)) == len(on_proxy)
    finally:
        if router is not None:
            await router.shutdown()
        if proxy is not None:
            await proxy.stop()
        for w in workers:
            await w.shutdown()


async def test_cancel_of_a_resumed_stream_stops_the_generation_on_its_worker(mesh: InProcessMesh) -> None:
    for backend in mesh.backends:
        backend.delay = 0.02
    first = mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="p", max_tokens=400, request_id="gs-c"))
    seen = [await first.read() for _ in range(3)]
    first.cancel()  # the worker keeps it for Resume
    caller = Caller(mesh)
    try:
        await caller.open()
        await caller.send(resume(1, "gs-c", after_seq=3))
        while len(caller.chunks[1]) < 2:
            assert await caller.read()
        await caller.send(cancel(1))
        await caller.until(1)
    finally:
        caller.call.cancel()
    chunks = seen + caller.chunks[1]
    assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1))
    assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_CANCELLED and len(chunks) < 100
    (generation,) = [g for b in mesh.backends for g in b.started]
    await asyncio.wait_for(generation.cancelled.wait(), 5)
