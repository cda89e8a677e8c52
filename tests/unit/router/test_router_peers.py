"""Router processes of one router: waiting for the siblings to list themselves, and tables passed on to them."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.support.mesh import wait_until
from tokenmesh.router import FORWARDED, Peers
from tokenmesh.v1 import router_pb2, router_pb2_grpc


class Recorder(router_pb2_grpc.ControlServicer):
    """A sibling's Control service that records what it is sent."""

    def __init__(self) -> None:
        self.versions: list[int] = []
        self.forwarded: list[bool] = []

    async def PushWeights(
        self,
        request_iterator: AsyncIterator[router_pb2.WeightTable],  # noqa: N802
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[router_pb2.WeightAck]:
        self.forwarded.append(FORWARDED in (context.invocation_metadata() or ()))
        async for table in request_iterator:
            self.versions.append(table.version)
            yield router_pb2.WeightAck(version=table.version, applied=True)


@contextlib.asynccontextmanager
async def sibling(recorder: Recorder) -> AsyncIterator[str]:
    server = grpc.aio.server()
    router_pb2_grpc.add_ControlServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


async def test_wait_listed_returns_once_every_sibling_is_listed(tmp_path: Path) -> None:
    peers = Peers(tmp_path, 0, 3)
    peers.register("127.0.0.1:1")
    waiting = asyncio.create_task(peers.wait_listed(5))
    Peers(tmp_path, 1, 3).register("127.0.0.1:2")
    await asyncio.sleep(0.1)
    assert not waiting.done()  # one of the two siblings still missing
    Peers(tmp_path, 2, 3).register("127.0.0.1:3")
    await asyncio.wait_for(waiting, 2)


async def test_wait_listed_gives_up_at_its_deadline_saying_how_many_started(tmp_path: Path) -> None:
    peers = Peers(tmp_path, 0, 3)
    Peers(tmp_path, 1, 3).register("127.0.0.1:2")
    with pytest.raises(TimeoutError, match="2 of 3 router processes started within 0.3 s"):
        await asyncio.wait_for(peers.wait_listed(0.3), 3)


async def test_a_link_reconnects_and_resends_the_latest_table(tmp_path: Path) -> None:
    peers = Peers(tmp_path, 0, 2)
    other = Peers(tmp_path, 1, 2)
    other.register(closed_port())  # listed, not listening yet
    try:
        peers.forward(router_pb2.WeightTable(version=1))
        peers.forward(router_pb2.WeightTable(version=2))
        first = Recorder()
        async with sibling(first) as address:
            other.register(address)  # it came up on another port: the next attempt reads the new listing
            await wait_until(lambda: first.versions == [2], timeout=10)  # only the latest, once
            peers.forward(router_pb2.WeightTable(version=3))
            await wait_until(lambda: first.versions == [2, 3])
        assert first.forwarded == [True]  # marked: the sibling applies it and passes it on to no one
        second = Recorder()
        async with sibling(second) as address:  # it restarted: the stream broke
            other.register(address)
            await wait_until(lambda: second.versions == [3], timeout=10)
    finally:
        await peers.close()
