"""One owner per set of peer connections: address -> channel, stubs, and the calls and tasks that use it.

A service's peers (the router's workers and sibling processes, the prober's
workers and routers, the client's routers) are :class:`Link` s held by one
:class:`Links` per set; nothing else opens a channel or makes a stub
(``tests/repo/test_connection_owners.py``). A link makes each stub class once (a
stub builds a callable per method: too much to do per call) and owns the work
that belongs to that peer: named per-peer tasks (a health watch, a stats
stream) and named calls opened ahead of need (the router's spare Generate).

Dropping a peer cancels its tasks and calls and closes its channels in the
background. A certificate renewal gives every link a new channel, so new calls
present the new certificate; per-peer tasks start again on it, calls opened
ahead are cancelled (the next one opens on the new channel), and the old
channel stays open until :meth:`Links.close` so that streams on it run to
their end (or is closed at once where every call on a link is one of its
tasks, ``keep_retired=False``).

A per-peer task may have a channel of its own, with options of its own (the
router's ``Worker/Link`` call: one HTTP/2 stream for every generation, which
the worker channel's small window would throttle). At a renewal such a task
is cancelled and left to drain (its body stops taking work and returns once
what runs on its call has ended), a new one starts on a new channel of its
own, and the old channel closes when the old task has ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import grpc

log = logging.getLogger(__name__)

Options = tuple[tuple[str, Any], ...]
ChannelFactory = Callable[[str, Options], grpc.aio.Channel]
"""Opens a channel to an address with channel options (e.g. ``Tls.channel``), with the credentials of now."""
Spawn = Callable[[Coroutine[Any, Any, Any], str], "asyncio.Task[Any]"]
"""Starts a background task under a name (a service's supervised ``spawn``)."""
PeerTask = Callable[["Link"], Coroutine[Any, Any, None]]
"""The body of a per-peer task, given the link (its stubs are those of the link's channel of the moment)."""

StubT = TypeVar("StubT")


class Link:
    """One peer: its channel, stubs made once per stub class, and the named tasks and calls that live on it.

    Made by :meth:`Links.open`.

    Args:
        address: the peer's ``host:port``.
        channel: the channel to it.
        spawn: starts the link's tasks.
        connect: opens the channels of tasks that have their own (None: no task may).
        close: closes a channel in the background (the owner's; a task's own channel once that task ended).

    """

    address: str
    channel: grpc.aio.Channel
    """The channel new calls go on (replaced at a certificate renewal)."""
    _stubs: dict[Callable[[grpc.aio.Channel], Any], Any]
    _bodies: dict[str, PeerTask]
    """Per-peer task bodies by name, started again on each new channel."""
    _tasks: dict[str, asyncio.Task[Any]]
    _calls: dict[str, Any]
    """Calls opened ahead of need by name (a grpc.aio call each; stubs are untyped)."""
    _retired: list[grpc.aio.Channel]
    """This peer's channels replaced at renewals, open while streams may run on them."""
    _own_options: dict[str, Options]
    """Per-peer tasks that run on a channel of their own, by name: that channel's options."""
    _own: dict[asyncio.Task[Any], Link]
    """Each running or draining task with a channel of its own: the link it was given (its channel, its stubs)."""
    _spawn: Spawn
    _connect: ChannelFactory | None
    _close: Callable[[grpc.aio.Channel], None]
    _dropped: bool

    def __init__(
        self,
        address: str,
        channel: grpc.aio.Channel,
        spawn: Spawn,
        connect: ChannelFactory | None = None,
        close: Callable[[grpc.aio.Channel], None] | None = None,
    ) -> None:
        self.address = address
        self.channel = channel
        self._spawn = spawn
        self._connect = connect
        self._close = close or (lambda _: None)
        self._dropped = False
        self._stubs = {}
        self._bodies = {}
        self._tasks = {}
        self._calls = {}
        self._retired = []
        self._own_options = {}
        self._own = {}

    def stub(self, kind: Callable[[grpc.aio.Channel], StubT]) -> StubT:
        """The stub of that class (e.g. ``worker_pb2_grpc.WorkerStub``) on the link's channel, made once per channel."""
        stub = self._stubs.get(kind)
        if stub is None:
            if self._dropped:
                # Its channel is closed: grpcio (1.85) can crash the process making a stub on a closed channel
                # (its registered call handle; a related race: grpc/grpc#43455, open).
                raise grpc.aio.UsageError(f"the link to {self.address} was dropped")
            stub = self._stubs[kind] = kind(self.channel)
        return stub

    def run(self, name: str, body: PeerTask, *, options: Options | None = None) -> None:
        """Run a per-peer task: started again on each new channel, cancelled when the peer is dropped.

        With options, the task runs on a channel of its own with those options: its body is given a link of
        that channel (same address). At a renewal it is cancelled and may drain (finish what runs on its call
        before it returns); its channel closes once it has ended.
        """
        self._bodies[name] = body
        if options is not None:
            if self._connect is None:
                raise ValueError(f"the link to {self.address} cannot open channels of its own (no connect)")
            self._own_options[name] = options
        self._start(name)

    def _start(self, name: str) -> None:
        old = self._tasks.pop(name, None)
        if old is not None:
            old.cancel()  # one with a channel of its own drains: its channel closes when it ends
        options = self._own_options.get(name)
        if options is None or self._connect is None:
            self._tasks[name] = self._spawn(self._bodies[name](self), f"{name} {self.address}")
            return
        own = Link(self.address, self._connect(self.address, options), self._spawn)
        task = self._tasks[name] = self._spawn(self._bodies[name](own), f"{name} {self.address}")
        self._own[task] = own
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[Any]) -> None:
        """A task with a channel of its own ended (drained, or dropped): close that channel."""
        own = self._own.pop(task, None)
        if own is not None and not self._dropped:  # dropped: closed with the link's
            own._dropped = True
            self._close(own.channel)

    @property
    def tasks(self) -> dict[str, asyncio.Task[Any]]:
        """The per-peer tasks running now, by name (a copy)."""
        return dict(self._tasks)

    def hold(self, name: str, call: Any) -> None:
        """Keep a call opened ahead of need (cancelled when the peer is dropped or its channel replaced)."""
        self._calls[name] = call

    def take(self, name: str) -> Any:
        """The call held under name, now the taker's (None when none is held)."""
        return self._calls.pop(name, None)

    def held(self, name: str) -> Any:
        """The call held under name, still the link's (None when none is held)."""
        return self._calls.get(name)

    def _renew(self, channel: grpc.aio.Channel) -> grpc.aio.Channel:
        """Move new calls and the tasks to channel; return the old one."""
        old, self.channel = self.channel, channel
        self._stubs.clear()
        self._cancel_calls()
        for name in list(self._bodies):
            self._start(name)
        return old

    def _cancel_calls(self) -> None:
        for call in self._calls.values():
            call.cancel()
        self._calls.clear()

    def _stop(self) -> list[grpc.aio.Channel]:
        """Cancel the tasks and calls; return every channel to close."""
        self._dropped = True
        self._stubs.clear()
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
        self._bodies.clear()
        self._cancel_calls()
        owned = []
        for own in self._own.values():  # draining ones too: their calls end with their channels
            own._dropped = True
            owned.append(own.channel)
        self._own.clear()
        channels, self._retired = [self.channel, *self._retired, *owned], []
        return channels


class Links:
    """Every link of one service to one kind of peer, by address: open, drop, renew, close.

    Args:
        connect: opens a channel to an address with the credentials of the moment (the router and prober:
            ``Tls.channel``; the client: its own credentials).
        options: the channel options every link's channel gets.
        spawn: starts the links' per-peer tasks (a service passes its supervised ``spawn``; default: plain
            tasks held here).
        keep_retired: at a renewal, keep each old channel open until :meth:`close` (streams on it run to their
            end); False: close it at once (every call on a link is one of its tasks, started again anyway).

    """

    _connect: ChannelFactory
    _options: Options
    _spawn: Spawn
    _keep_retired: bool
    _links: dict[str, Link]
    _own_tasks: set[asyncio.Task[Any]]
    """Per-peer tasks started without a service's spawn (held so they are not collected)."""
    _closing: set[asyncio.Task[None]]
    """Channels being closed in the background (held until done, so none is collected mid-close)."""

    def __init__(
        self, connect: ChannelFactory, options: Options = (), *, spawn: Spawn | None = None, keep_retired: bool = True
    ) -> None:
        self._connect = connect
        self._options = options
        self._spawn = spawn or self._plain_task
        self._keep_retired = keep_retired
        self._links = {}
        self._own_tasks = set()
        self._closing = set()

    def _plain_task(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._own_tasks.add(task)
        task.add_done_callback(self._own_tasks.discard)
        return task

    def __contains__(self, address: object) -> bool:
        return address in self._links

    def __getitem__(self, address: str) -> Link:
        return self._links[address]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._links))

    def __len__(self) -> int:
        return len(self._links)

    def get(self, address: str) -> Link | None:
        """The link to address, if open."""
        return self._links.get(address)

    def items(self) -> list[tuple[str, Link]]:
        """Every (address, link) open now."""
        return list(self._links.items())

    def open(self, address: str) -> Link:
        """The link to address, opened now if it is not yet (the channel connects on its first call)."""
        link = self._links.get(address)
        if link is None:
            channel = self._connect(address, self._options)
            link = self._links[address] = Link(address, channel, self._spawn, self._connect, self._close_later)
        return link

    def drop(self, address: str) -> None:
        """Forget a peer: cancel its tasks and calls, close its channels in the background."""
        link = self._links.pop(address, None)
        if link is not None:
            for channel in link._stop():  # noqa: SLF001 - the owner stops its own links
                self._close_later(channel)

    def renew(self) -> None:
        """A new channel per link (the credentials of now): new calls and the per-peer tasks go on it."""
        for link in self._links.values():
            old = link._renew(self._connect(link.address, self._options))  # noqa: SLF001 - the owner renews its own links
            if self._keep_retired:
                link._retired.append(old)  # noqa: SLF001
            else:
                self._close_later(old)

    def _close_later(self, channel: grpc.aio.Channel) -> None:
        closing = asyncio.create_task(channel.close())
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Drop every link and close every channel, retired ones included (safe to call twice)."""
        for address in list(self._links):
            self.drop(address)
        for task in list(self._own_tasks):
            task.cancel()
        if self._closing:
            await asyncio.wait(set(self._closing))


async def follow_renewals(renewals: AsyncIterator[None], *sets: Links) -> None:
    """Renew every link of every set at each renewal of the certificate files (``Tls.renewals()``), for ever.

    One loop for all of a service's sets: each pass of ``Tls.renewals()`` sees a renewal once.
    """
    async for _ in renewals:
        log.info("TLS certificate files changed: new channels to %d peers", sum(len(links) for links in sets))
        for links in sets:
            links.renew()
