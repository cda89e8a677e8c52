"""Links, the owner of a service's peer connections, against a real health server on 127.0.0.1:0."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenmesh.health import HealthServicer
from tokenmesh.links import Link, Links, follow_renewals
from tokenmesh.tls import open_channel
from tokenmesh.v1 import worker_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
WHOLE = health_pb2.HealthCheckRequest(service="")


@pytest.fixture
async def peer() -> AsyncIterator[tuple[str, HealthServicer]]:
    """A peer serving grpc.health.v1.Health ('' SERVING); its address and servicer."""
    servicer = HealthServicer([])
    await servicer.set("", SERVING)
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        await server.stop(0)


class Opened:
    """A channel factory that remembers every channel it opened, in order."""

    channels: list[grpc.aio.Channel]

    def __init__(self) -> None:
        self.channels = []

    def __call__(self, address: str, options: tuple[tuple[str, Any], ...]) -> grpc.aio.Channel:
        channel = open_channel(address, None, options)
        self.channels.append(channel)
        return channel


async def fails_soon(stub: health_pb2_grpc.HealthStub) -> None:
    """A call on the stub's channel fails (UsageError once it is closed) within 5 s.

    The stub is made before the channel closes: grpcio (1.85) can crash the process making one on a closed channel.
    """
    async with asyncio.timeout(5):
        while True:
            try:
                await stub.Check(WHOLE, timeout=1)
            except grpc.aio.UsageError:
                return
            await asyncio.sleep(0.01)


class Watcher:
    """A per-peer task body: one health Watch per start, recording the channel it ran on and what it heard."""

    started_on: list[grpc.aio.Channel]
    heard: list[int]
    listening: asyncio.Event

    def __init__(self) -> None:
        self.started_on = []
        self.heard = []
        self.listening = asyncio.Event()

    async def __call__(self, link: Link) -> None:
        self.started_on.append(link.channel)
        async for update in link.stub(health_pb2_grpc.HealthStub).Watch(WHOLE):
            self.heard.append(update.status)
            self.listening.set()


async def test_open_gives_one_link_per_address_and_one_stub_per_class(peer: tuple[str, HealthServicer]) -> None:
    address, _ = peer
    opened = Opened()
    links = Links(opened)
    try:
        link = links.open(address)
        assert links.open(address) is link and links[address] is link and list(links) == [address]
        assert len(opened.channels) == 1 and link.channel is opened.channels[0]
        health = link.stub(health_pb2_grpc.HealthStub)
        assert link.stub(health_pb2_grpc.HealthStub) is health
        assert link.stub(worker_pb2_grpc.WorkerStub) is not health
        assert (await health.Check(WHOLE, timeout=5)).status == SERVING
        assert links.get("127.0.0.1:1") is None and "127.0.0.1:1" not in links
    finally:
        await links.close()


async def test_drop_cancels_the_peers_tasks_and_calls_and_closes_its_channel(
    peer: tuple[str, HealthServicer],
) -> None:
    address, _ = peer
    spawned: list[str] = []
    tasks: list[asyncio.Task[Any]] = []

    def spawn(coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        spawned.append(name)
        tasks.append(asyncio.create_task(coro))
        return tasks[-1]

    links = Links(Opened(), spawn=spawn)
    watcher = Watcher()
    link = links.open(address)
    link.run("watch", watcher)
    held = link.stub(health_pb2_grpc.HealthStub).Watch(WHOLE)
    link.hold("ahead", held)
    assert link.held("ahead") is held
    await asyncio.wait_for(watcher.listening.wait(), 5)
    assert spawned == [f"watch {address}"] and set(link.tasks) == {"watch"}
    on_channel = health_pb2_grpc.HealthStub(link.channel)

    links.drop(address)
    assert address not in links
    with pytest.raises(asyncio.CancelledError):
        await tasks[0]
    assert held.cancelled()
    await fails_soon(on_channel)
    with pytest.raises(grpc.aio.UsageError, match="dropped"):  # nobody makes a stub on its closed channel
        link.stub(worker_pb2_grpc.WorkerStub)
    links.drop(address)  # a second drop of the same peer is nothing
    await links.close()


async def test_a_renewal_gives_new_channels_and_restarts_tasks_while_a_stream_on_the_old_channel_runs_on(
    peer: tuple[str, HealthServicer],
) -> None:
    address, servicer = peer
    opened = Opened()
    links = Links(opened)
    watcher = Watcher()
    link = links.open(address)
    link.run("watch", watcher)
    old_stub = link.stub(health_pb2_grpc.HealthStub)
    stream = old_stub.Watch(WHOLE)
    assert (await stream.read()).status == SERVING
    ahead = old_stub.Watch(WHOLE)
    link.hold("ahead", ahead)
    await asyncio.wait_for(watcher.listening.wait(), 5)
    first_task = link.tasks["watch"]
    renewals: asyncio.Queue[None] = asyncio.Queue()

    async def from_queue() -> AsyncIterator[None]:
        while True:
            await renewals.get()
            yield

    on_old = health_pb2_grpc.HealthStub(link.channel)
    follow = asyncio.create_task(follow_renewals(from_queue(), links))
    try:
        watcher.listening.clear()
        renewals.put_nowait(None)
        await asyncio.wait_for(watcher.listening.wait(), 5)  # the task started again, on the new channel
        assert len(opened.channels) == 2 and link.channel is opened.channels[1]
        assert watcher.started_on == opened.channels
        assert first_task.cancelled() and link.tasks["watch"] is not first_task
        assert link.stub(health_pb2_grpc.HealthStub) is not old_stub
        assert ahead.cancelled() and link.held("ahead") is None  # the next one opens on the new channel

        await servicer.set("", NOT_SERVING)
        assert (await asyncio.wait_for(stream.read(), 5)).status == NOT_SERVING  # the old stream runs on
        await asyncio.wait_for(_heard(watcher, NOT_SERVING), 5)
    finally:
        follow.cancel()
        await links.close()
    await fails_soon(on_old)


async def _heard(watcher: Watcher, status: int) -> None:
    while watcher.heard[-1] != status:
        await asyncio.sleep(0.01)


async def test_close_closes_retired_channels_too_and_may_be_called_twice(peer: tuple[str, HealthServicer]) -> None:
    address, _ = peer
    opened = Opened()
    links = Links(opened)
    stream = links.open(address).stub(health_pb2_grpc.HealthStub).Watch(WHOLE)
    assert (await stream.read()).status == SERVING
    links.renew()
    assert len(opened.channels) == 2
    on_each = [health_pb2_grpc.HealthStub(channel) for channel in opened.channels]
    await links.close()
    with pytest.raises(asyncio.CancelledError):  # a closed channel cancels its calls
        await stream.read()
    assert stream.cancelled()
    for stub in on_each:
        await fails_soon(stub)
    assert len(links) == 0
    await links.close()


async def test_without_keep_retired_a_renewal_closes_the_old_channel_at_once(peer: tuple[str, HealthServicer]) -> None:
    address, _ = peer
    opened = Opened()
    links = Links(opened, keep_retired=False)
    try:
        old = links.open(address).stub(health_pb2_grpc.HealthStub)
        stream = old.Watch(WHOLE)
        assert (await stream.read()).status == SERVING
        links.renew()
        with pytest.raises(asyncio.CancelledError):  # a closed channel cancels its calls
            await asyncio.wait_for(stream.read(), 5)
        assert stream.cancelled()
        await fails_soon(old)
        assert (await links[address].stub(health_pb2_grpc.HealthStub).Check(WHOLE, timeout=5)).status == SERVING
    finally:
        await links.close()
