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
    options: list[tuple[tuple[str, Any], ...]]
    """Each channel's options, in the same order."""

    def __init__(self) -> None:
        self.channels = []
        self.options = []

    def __call__(self, address: str, options: tuple[tuple[str, Any], ...]) -> grpc.aio.Channel:
        channel = open_channel(address, None, options)
        self.channels.append(channel)
        self.options.append(options)
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


class Drainer:
    """A per-peer task body on a channel of its own: a Watch, and when cancelled it drains until released."""

    links: list[Link]
    streams: list[Any]
    released: asyncio.Event
    draining: asyncio.Event

    def __init__(self) -> None:
        self.links = []
        self.streams = []
        self.released = asyncio.Event()
        self.draining = asyncio.Event()

    async def __call__(self, link: Link) -> None:
        self.links.append(link)
        stream = link.stub(health_pb2_grpc.HealthStub).Watch(WHOLE)
        self.streams.append(stream)
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            self.draining.set()
            await self.released.wait()  # what runs on its call finishes first
            raise


async def test_a_task_with_a_channel_of_its_own_drains_at_a_renewal_and_its_old_channel_closes_when_it_ends(
    peer: tuple[str, HealthServicer],
) -> None:
    address, servicer = peer
    opened = Opened()
    links = Links(opened, (("grpc.http2.lookahead_bytes", 4096),))
    drainer = Drainer()
    wide = (("grpc.http2.lookahead_bytes", 1 << 20),)
    try:
        link = links.open(address)
        link.run("link", drainer, options=wide)
        first = link.tasks["link"]
        await wait_for_streams(drainer, 1)
        assert len(opened.channels) == 2 and opened.options[1] == wide  # the link's own channel, its own options
        assert drainer.links[0].channel is opened.channels[1] and drainer.links[0].address == address
        assert (await drainer.streams[0].read()).status == SERVING
        links.renew()  # a new channel for the link, and a new one of its own for the task
        await wait_for_streams(drainer, 2)
        assert drainer.links[1].channel is opened.channels[3] and opened.options[3] == wide
        await asyncio.wait_for(drainer.draining.wait(), 5)
        assert not first.done()  # draining: its channel is open and its stream runs on
        await servicer.set("", NOT_SERVING)
        assert (await asyncio.wait_for(drainer.streams[0].read(), 5)).status == NOT_SERVING
        on_old = health_pb2_grpc.HealthStub(opened.channels[1])
        drainer.released.set()
        await asyncio.wait({first}, timeout=5)
        assert first.cancelled()
        await fails_soon(on_old)  # closed once its task ended, not at close()
        async with asyncio.timeout(5):  # the new task's stream runs on: it hears the change too
            while (await drainer.streams[1].read()).status != NOT_SERVING:
                pass
    finally:
        await links.close()
    await fails_soon(health_pb2_grpc.HealthStub(opened.channels[3]))  # dropped: the task's own channel closed too


async def wait_for_streams(drainer: Drainer, n: int) -> None:
    async with asyncio.timeout(5):
        while len(drainer.streams) < n:
            await asyncio.sleep(0.01)
