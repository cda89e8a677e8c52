"""tokenmesh.client on Inference/GenerateStream: many generations on one call, breaks resumed, old routers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.support.mesh import InProcessMesh, assert_exact, in_process_mesh, wait_until
from tests.support.tcp_proxy import TcpProxy
from tokenmesh.client import Client
from tokenmesh.errors import DeadlineExceeded, Unimplemented
from tokenmesh.router import Router, RouterConfig
from tokenmesh.router._inference import InferenceServicer
from tokenmesh.v1 import inference_pb2


class CountedCall:
    """A GenerateStream call whose messages from the router are counted."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.reads = 0

    async def read(self) -> Any:
        self.reads += 1
        return await self.call.read()

    async def write(self, message: Any) -> None:
        await self.call.write(message)

    def cancel(self) -> bool:
        return bool(self.call.cancel())


def counted(client: Client) -> list[tuple[str, CountedCall]]:
    """Every GenerateStream call the client opens from now on, with its router's address."""
    opened: list[tuple[str, CountedCall]] = []
    real = client._generate_stream  # noqa: SLF001 - the test watches the client's calls

    def open_call(address: str) -> CountedCall:
        opened.append((address, CountedCall(real(address))))
        return opened[-1][1]

    client._sessions._open_call = open_call  # noqa: SLF001
    return opened


async def generate(
    client: Client, max_tokens: int, *, prompt_pad: int = 0, **fields: Any
) -> list[inference_pb2.GenerateChunk]:
    request = inference_pb2.GenerateRequest(prompt="p" + "x" * prompt_pad, max_tokens=max_tokens, **fields)
    return [c async for c in client.generate(request)]


async def test_dozens_of_generations_share_one_call_every_chunk_exact(mesh: InProcessMesh) -> None:
    for backend in mesh.backends:
        backend.delay = 0.005
    async with Client(mesh.router.host.address) as client:
        opened = counted(client)
        sizes = [20 + i % 13 for i in range(40)]
        results = await asyncio.gather(*(generate(client, n) for n in sizes))
        for chunks, n in zip(results, sizes, strict=True):
            assert_exact(chunks, n)
        (address, call), *more = opened
        assert address == mesh.router.host.address and not more  # one call carried all 40
        assert client._sessions._sessions[address]._next == 40  # noqa: SLF001 - every generation a stream on it
        chunks = sum(len(r) for r in results)
        assert call.reads < chunks  # a message carries the chunks of several generations
        assert sum(len(b.started) for b in mesh.backends) == 40
        assert len(mesh.router.inference.streams.calls) == 1  # the router's side: the one call, still open
    await wait_until(lambda: not mesh.router.inference.streams.calls)  # closed with the client


async def test_a_router_cut_mid_stream_breaks_its_call_and_each_generation_resumes_elsewhere_once() -> None:
    async with in_process_mesh(backend_settings={"delay": 0.01}) as mesh:
        other = Router(RouterConfig(port=0, workers=tuple(w.host.address for w in mesh.workers), drain_grace_s=1))
        await other.start()
        proxy = TcpProxy("127.0.0.1", mesh.router.host.port)
        await proxy.start()
        try:
            await wait_until(lambda: all(e.healthy and e.models for e in other.pool.entries.values()))
            async with Client([proxy.address, other.host.address]) as client:
                client._turn = -1  # noqa: SLF001 - generations alternate, the proxy first
                opened = counted(client)
                results: list[list[inference_pb2.GenerateChunk]] = [[] for _ in range(24)]

                async def one(i: int) -> None:
                    async for chunk in client.generate(inference_pb2.GenerateRequest(prompt="p", max_tokens=60)):
                        results[i].append(chunk)

                tasks = [asyncio.create_task(one(i)) for i in range(24)]
                await wait_until(lambda: all(len(r) >= 5 for r in results), timeout=10)
                proxy.cut()  # the call to the first router is reset with 12 generations on it
                await asyncio.gather(*tasks)
                for chunks in results:
                    assert_exact(chunks, 60)
                assert sum(len(b.started) for b in mesh.backends) == 24  # resumed, never run twice
                assert [a for a, _ in opened] == [proxy.address, other.host.address]
                client._turn = -1  # noqa: SLF001 - the next generation to the cut router opens a new call
                assert_exact(await generate(client, 5), 5)
                assert [a for a, _ in opened] == [proxy.address, other.host.address, proxy.address]
        finally:
            await proxy.stop()
            await other.shutdown()


async def old_generate_stream(self: InferenceServicer, request_iterator: Any, context: Any) -> Any:
    raise Unimplemented("Method not implemented!")
    yield  # pragma: no cover


async def test_a_router_that_predates_generatestream_gets_generate_calls_and_is_asked_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(InferenceServicer, "GenerateStream", old_generate_stream)  # an old router
    async with in_process_mesh() as mesh, Client(mesh.router.host.address) as client:
        opened = counted(client)
        results = await asyncio.gather(*(generate(client, 10 + i) for i in range(12)))
        for i, chunks in enumerate(results):
            assert_exact(chunks, 10 + i)
        assert_exact(await generate(client, 4), 4)
        assert [a for a, _ in opened] == [mesh.router.host.address]  # asked once, remembered
        assert client._sessions.unbatched == {mesh.router.host.address}  # noqa: SLF001
        rest = [c async for c in client.resume(results[0][-1].request_id, after_seq=3)]
        assert [c.seq for c in rest] == list(range(4, len(results[0]) + 1))  # Resume too, as a call of its own


async def test_a_generation_cut_and_resumed_on_an_old_router_goes_over_resume() -> None:
    async with in_process_mesh(backend_settings={"delay": 0.01}) as mesh:
        proxy = TcpProxy("127.0.0.1", mesh.router.host.port)
        await proxy.start()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(InferenceServicer, "GenerateStream", old_generate_stream)
            old = Router(RouterConfig(port=0, workers=tuple(w.host.address for w in mesh.workers), drain_grace_s=1))
            await old.start()
        try:
            await wait_until(lambda: all(e.healthy and e.models for e in old.pool.entries.values()))
            async with Client([proxy.address, old.host.address]) as client:
                client._turn = -1  # noqa: SLF001 - the new router (through the proxy) first
                chunks = []
                async for chunk in client.generate(inference_pb2.GenerateRequest(prompt="p", max_tokens=60)):
                    chunks.append(chunk)
                    if chunk.seq == 10:
                        proxy.cut()
                assert_exact(chunks, 60)
                assert sum(len(b.started) for b in mesh.backends) == 1
                assert client._sessions.unbatched == {old.host.address}  # noqa: SLF001
        finally:
            await proxy.stop()
            await old.shutdown()


async def test_a_streams_deadline_ends_it_alone_and_its_made_up_id_is_cancelled(mesh: InProcessMesh) -> None:
    for backend in mesh.backends:
        backend.delay = 0.02
    async with Client(mesh.router.host.address) as client:
        whole = asyncio.create_task(generate(client, 30))
        with pytest.raises(DeadlineExceeded):
            [c async for c in client.generate(inference_pb2.GenerateRequest(prompt="p", max_tokens=500), timeout=0.3)]
        assert_exact(await whole, 30)  # the other stream on the call went on
        await wait_until(lambda: sum(g.cancelled.is_set() for b in mesh.backends for g in b.started) == 1, timeout=3)
        assert len(client._sessions._sessions) == 1  # noqa: SLF001 - one call served both


async def test_a_caller_that_stops_reading_its_own_id_detaches_it_and_resumes_it_on_the_same_call(
    mesh: InProcessMesh,
) -> None:
    for backend in mesh.backends:
        backend.delay = 0.01
    async with Client(mesh.router.host.address) as client:
        opened = counted(client)
        request = inference_pb2.GenerateRequest(prompt="p", max_tokens=40, request_id="mine-7")
        first = []
        stream = client.generate(request)
        async for chunk in stream:
            first.append(chunk)
            if chunk.seq == 3:
                break
        await stream.aclose()  # detached: a caller-given id runs on for Resume
        rest = [c async for c in client.resume("mine-7", after_seq=3)]
        assert_exact(first + rest, 40)
        (generation,) = [g for b in mesh.backends for g in b.started]
        assert not generation.cancelled.is_set()
        assert len(opened) == 1 and client._sessions._sessions[opened[0][0]]._next == 2  # noqa: SLF001


async def test_a_request_too_big_to_share_a_message_goes_over_generate(mesh: InProcessMesh) -> None:
    async with Client(mesh.router.host.address) as client:
        opened = counted(client)
        big, small = await asyncio.gather(generate(client, 6, prompt_pad=300_000), generate(client, 6))
        assert_exact(big, 6)
        assert_exact(small, 6)
        assert [a for a, _ in opened] == [mesh.router.host.address]
        assert client._sessions._sessions[mesh.router.host.address]._next == 1  # noqa: SLF001 - the small one only
        started = sorted(len(g.params.prompt) for b in mesh.backends for g in b.started)
        assert started[-1] > 300_000  # the big prompt reached the worker whole, on a Generate call


async def test_with_batched_off_every_generation_is_a_call_of_its_own(mesh: InProcessMesh) -> None:
    async with Client(mesh.router.host.address, batched=False) as client:
        opened = counted(client)
        for chunks in await asyncio.gather(*(generate(client, 8) for _ in range(6))):
            assert_exact(chunks, 8)
        assert opened == [] and not mesh.router.inference.streams.calls
