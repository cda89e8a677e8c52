"""tokenmesh.client: retries before the first chunk, transparent resume on another router, errors, cancel."""

from __future__ import annotations

import asyncio
import socket

import pytest

from tests.support.mesh import InProcessMesh, in_process_mesh, wait_until
from tests.support.tcp_proxy import TcpProxy
from tokenmesh.client import Client, SyncClient
from tokenmesh.errors import InvalidArgument, NotFound, Unavailable
from tokenmesh.router import Router, RouterConfig
from tokenmesh.v1 import inference_pb2


def dead_address() -> str:
    """host:port where nothing listens (connections refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def texts(chunks: list[inference_pb2.GenerateChunk]) -> str:
    return "".join(c.text for c in chunks)


async def test_a_router_that_is_down_is_skipped_before_the_first_chunk(mesh: InProcessMesh) -> None:
    async with Client([dead_address(), mesh.router.host.address]) as client:
        for _ in range(3):  # whichever router comes first in turn
            chunks = [c async for c in client.generate(inference_pb2.GenerateRequest(prompt="hi", max_tokens=5))]
            assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1))
            assert texts(chunks) == "tok0 tok1 tok2 tok3 tok4 "
            assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH


async def test_caller_errors_are_the_mesh_classes_and_are_not_retried(mesh: InProcessMesh) -> None:
    async with Client(mesh.router.host.address) as client:
        with pytest.raises(InvalidArgument, match="max_tokens"):
            [c async for c in client.generate(inference_pb2.GenerateRequest(prompt="hi", max_tokens=100_000))]
        with pytest.raises(NotFound, match="unknown model 'nope'"):
            [c async for c in client.generate(inference_pb2.GenerateRequest(prompt="hi", model="nope"))]
    async with Client([dead_address()], retry_deadline_s=0.5) as client:
        with pytest.raises(Unavailable):
            [c async for c in client.generate(inference_pb2.GenerateRequest(prompt="hi", max_tokens=3))]


async def test_a_stream_cut_mid_generation_resumes_on_another_router_every_seq_once() -> None:
    async with in_process_mesh(backend_settings={"delay": 0.01}) as mesh:
        other = Router(RouterConfig(port=0, workers=tuple(w.host.address for w in mesh.workers), drain_grace_s=1))
        await other.start()
        proxy = TcpProxy("127.0.0.1", mesh.router.host.port)
        await proxy.start()
        try:
            await wait_until(lambda: all(e.healthy and e.models for e in other.pool.entries.values()))
            # The proxy first in turn: the stream starts through it.
            async with Client([proxy.address, other.host.address]) as client:
                client._turn = -1  # noqa: SLF001 - deterministic order for the test
                chunks = []
                async for chunk in client.generate(inference_pb2.GenerateRequest(prompt="long", max_tokens=60)):
                    chunks.append(chunk)
                    if chunk.seq == 10:
                        proxy.cut()  # the connection to the first router is reset mid-stream
            assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1)) and len(chunks) > 10
            assert texts(chunks) == "".join(f"tok{i} " for i in range(60))
            assert chunks[-1].usage.completion_tokens == 60
            assert sum(len(b.started) for b in mesh.backends) == 1  # resumed, never run twice
        finally:
            await proxy.stop()
            await other.shutdown()


async def test_a_caller_that_stops_reading_cancels_a_generation_whose_id_the_client_made(
    mesh: InProcessMesh,
) -> None:
    for backend in mesh.backends:
        backend.delay = 0.05
    async with Client(mesh.router.host.address) as client:
        stream = client.generate(inference_pb2.GenerateRequest(prompt="long", max_tokens=500))
        async for chunk in stream:
            if chunk.seq == 3:
                break
        await stream.aclose()
        await wait_until(lambda: all(g.cancelled.is_set() for b in mesh.backends for g in b.started), timeout=3)
        await wait_until(lambda: sum(e.in_flight for e in mesh.router.pool.entries.values()) == 0, timeout=3)


async def test_resume_by_id_replays_after_a_seq(mesh: InProcessMesh) -> None:
    async with Client(mesh.router.host.address) as client:
        request = inference_pb2.GenerateRequest(prompt="hi", max_tokens=8, request_id="mine-1")
        whole = [c async for c in client.generate(request)]
        rest = [c async for c in client.resume("mine-1", after_seq=5)]
    assert [c.seq for c in rest] == [c.seq for c in whole[5:]]
    assert texts(rest) == texts(whole[5:])


async def test_the_sync_client_streams_and_raises_the_same_errors(mesh: InProcessMesh) -> None:
    address = mesh.router.host.address

    def run() -> tuple[list[int], str]:
        with SyncClient([address]) as client:
            seqs = [c.seq for c in client.generate(inference_pb2.GenerateRequest(prompt="hi", max_tokens=4))]
            try:
                list(client.generate(inference_pb2.GenerateRequest(prompt="hi", model="nope")))
            except NotFound as exc:
                return seqs, str(exc)
        return seqs, ""

    seqs, error = await asyncio.to_thread(run)
    assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) >= 2
    assert "unknown model 'nope'" in error


def test_bad_router_addresses_are_refused() -> None:
    with pytest.raises(ValueError, match="give at least one router"):
        Client([])
    with pytest.raises(ValueError, match="router address 'nohost': must be host:port"):
        Client("nohost")
