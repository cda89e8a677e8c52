"""Cancel on the router: of a queued generation, of one no router stream holds, and its fan-out to workers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from tests.support.fakes import FakeBackend
from tests.support.mesh import InProcessMesh, wait_until
from tokenmesh.router import Router, RouterConfig
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc
from tokenmesh.worker import Worker, WorkerConfig

pytestmark = pytest.mark.usefixtures("mesh_road")  # down the Link and the per-generation road alike

SLOTS = 8  # two fake workers x 4 slots


async def fill(mesh: InProcessMesh) -> list[grpc.aio.UnaryStreamCall]:
    """SLOTS long generations, each with its first chunk read (so each holds a worker slot)."""
    for backend in mesh.backends:
        backend.delay = 0.05
    calls = [
        mesh.inference.Generate(inference_pb2.GenerateRequest(prompt=f"fill{i}", max_tokens=400)) for i in range(SLOTS)
    ]
    await asyncio.gather(*(c.read() for c in calls))
    return calls


async def test_cancel_of_a_queued_generation_answers_cancelled_and_ends_it_at_once(mesh: InProcessMesh) -> None:
    running = await fill(mesh)
    try:
        queued = mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="queued", max_tokens=2, request_id="q1"))
        await wait_until(lambda: len(mesh.router.admission.waiting) == 1)
        response = await mesh.inference.Cancel(inference_pb2.CancelRequest(request_id="q1"), timeout=5)
        assert response.cancelled
        # At once: the running generations hold every slot for another ~20 s (400 tokens x 50 ms).
        chunks = await asyncio.wait_for(_read_all(queued), 2)
        assert [(c.seq, c.finish_reason, c.usage.completion_tokens) for c in chunks] == [
            (1, inference_pb2.FINISH_REASON_CANCELLED, 0)
        ]
        assert chunks[0].request_id == "q1"
        assert mesh.router.admission.waiting == []
        assert "q1" not in mesh.router.inference.live.by_id
    finally:
        for call in running:
            call.cancel()
    # The freed slots do not start it later.
    await wait_until(lambda: all(e.in_flight == 0 for e in mesh.router.pool.entries.values()))
    assert "queued" not in [g.params.prompt for b in mesh.backends for g in b.started]
    chunks = await _read_all(mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="after", max_tokens=2)))
    assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH


async def _read_all(call: grpc.aio.UnaryStreamCall) -> list[inference_pb2.GenerateChunk]:
    return [c async for c in call]


async def _read_rest(call: grpc.aio.UnaryStreamCall) -> list[inference_pb2.GenerateChunk]:
    """The chunks after those taken with read() (a call is read one way only)."""
    rest = []
    while (chunk := await call.read()) is not grpc.aio.EOF:
        rest.append(chunk)
    return rest


@pytest.mark.parametrize(
    "rpc",
    ["Cancel", "Resume"],
    ids=["cancel-with-empty-id", "resume-with-empty-id"],
)
async def test_an_empty_request_id_is_invalid_argument(mesh: InProcessMesh, rpc: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        if rpc == "Cancel":
            await mesh.inference.Cancel(inference_pb2.CancelRequest(request_id=""), timeout=5)
        else:
            await _read_all(mesh.inference.Resume(inference_pb2.ResumeRequest(request_id=""), timeout=5))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id is required" in (info.value.details() or "")


class SilentPeer:
    """Accepts TCP connections and never answers: a worker that hangs (e.g. SIGSTOPped)."""

    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._handlers: set[asyncio.Task[None]] = set()
        self.address = ""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._hold, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):
                pass

    async def stop(self) -> None:
        for writer in self._writers:
            writer.close()
        await asyncio.gather(*self._handlers, return_exceptions=True)  # each sees EOF and returns
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@contextlib.asynccontextmanager
async def mesh_with_a_bad_worker(
    kind: str = "silent",
) -> AsyncIterator[tuple[Router, list[FakeBackend], grpc.aio.Channel]]:
    """A router whose first configured worker never answers ("silent") or refuses connections ("refused"),
    then two real workers."""
    silent = SilentPeer()
    backends = [FakeBackend(delay=0.05), FakeBackend(delay=0.05)]
    workers = [Worker(WorkerConfig(port=0, drain_grace_s=1), backend=b) for b in backends]
    router: Router | None = None
    try:
        await silent.start()
        for worker in workers:
            await worker.start()
        bad = silent.address if kind == "silent" else closed_port()
        addresses = (bad, *(w.host.address for w in workers))
        router = Router(RouterConfig(port=0, workers=addresses, drain_grace_s=1, stop_grace_s=0.2))
        await router.start()
        live = [router.pool.entries[w.host.address] for w in workers]
        await wait_until(lambda: all(e.healthy and e.models for e in live))
        async with grpc.aio.insecure_channel(router.host.address) as channel:
            yield router, backends, channel
    finally:
        if router is not None:
            await router.shutdown()
        for worker in workers:
            await worker.shutdown()
        await silent.stop()


@pytest.mark.parametrize("kind", ["silent", "refused"], ids=["silent-worker", "refusing-worker"])
async def test_cancel_fan_out_answers_from_the_worker_that_holds_it_without_waiting_for_a_bad_one(
    kind: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with mesh_with_a_bad_worker(kind) as (router, backends, channel):
        stub = inference_pb2_grpc.InferenceStub(channel)
        call = stub.Generate(inference_pb2.GenerateRequest(prompt="p", max_tokens=400, request_id="held"))
        await call.read()
        call.cancel()  # detached: no router stream holds it, its worker does
        await wait_until(lambda: "held" not in router.inference.live.by_id)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="tokenmesh.router"):
            response = await stub.Cancel(inference_pb2.CancelRequest(request_id="held"), timeout=10)
        elapsed = time.monotonic() - started
        assert response.cancelled
        # Asked one after another, a silent worker listed first took its whole 5 s before the others were asked.
        # 2 s: the answer takes milliseconds; the bound is generous for a loaded 2-core machine.
        assert elapsed < 2.0, f"Cancel took {elapsed:.1f} s"
        # Warnings only: an earlier test may leave the router's loggers at INFO, and its start logs then. The
        # refusing worker's link retrying (its own warning, whenever its fifth failure falls) is not the Cancel's.
        warned = [
            r
            for r in caplog.records
            if r.name.startswith("tokenmesh.router")
            and r.levelno >= logging.WARNING
            and not r.getMessage().startswith("worker link to ")
        ]
        assert not [r.getMessage() for r in warned]
        generation = next(g for b in backends for g in b.started if g.params.prompt == "p")
        await asyncio.wait_for(generation.cancelled.wait(), 2)


async def test_cancel_of_an_unknown_id_is_not_found_within_the_callers_deadline_naming_the_silent_worker() -> None:
    async with mesh_with_a_bad_worker() as (router, _, channel):
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Cancel(inference_pb2.CancelRequest(request_id="nobody-has-it"), timeout=2)
        # NOT_FOUND, not DEADLINE_EXCEEDED: the router answered within the caller's 2 s, though one worker never does.
        assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value
        details = info.value.details() or ""
        assert "no live generation with request_id 'nobody-has-it'" in details
        assert f"could not ask {router.config.workers[0]}" in details


async def test_cancel_of_a_resumed_stream_stops_the_generation_on_its_worker(mesh: InProcessMesh) -> None:
    for backend in mesh.backends:
        backend.delay = 0.05
    call = mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="p", max_tokens=400, request_id="r"))
    await call.read()
    call.cancel()
    resumed = mesh.inference.Resume(inference_pb2.ResumeRequest(request_id="r", after_seq=1), timeout=10)
    await resumed.read()
    assert mesh.router.inference.live.by_id["r"].resumed
    response = await mesh.inference.Cancel(inference_pb2.CancelRequest(request_id="r"), timeout=5)
    assert response.cancelled
    rest = await asyncio.wait_for(_read_rest(resumed), 2)
    assert rest[-1].finish_reason == inference_pb2.FINISH_REASON_CANCELLED
    generation = next(g for b in mesh.backends for g in b.started if g.params.prompt == "p")
    assert generation.cancelled.is_set()
