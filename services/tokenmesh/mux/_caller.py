"""The caller end of a multiplexed call: streams read as calls of their own, commands and credit written in batches.

One :class:`CallerSession` is one open call: one reader task demultiplexes
each message into the streams' mailboxes (:class:`Inbox`) and never waits for
a consumer (credit bounds every mailbox); one writer task (:class:`Outbox`)
sends everything pending when it runs (starts, cancels, detaches and credit)
as one message, so what is queued during a write goes in the next one. Each
stream's one consumer returns the credit it took in batches of a quarter of
the window. When the call ends, every stream still on it gets its own copy
of the failure (an exception raised in many tasks would share a traceback).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf.message import Message

from tokenmesh.mux._wire import SETTINGS_WAIT_S

Event = TypeVar("Event")
Command = TypeVar("Command", bound=Message)
Stream = TypeVar("Stream", bound="Inbox[Any]")

FRAMING_BYTES = 8
"""What a command costs in its message beyond its own bytes (its field tag and length), counted generously."""


async def read_settings(call: Any, peer: str) -> Any:
    """The server end's settings, the call's first message; the call is cancelled when they do not come.

    Raises the call's ``grpc.aio.AioRpcError``, TimeoutError after :data:`SETTINGS_WAIT_S`, or ConnectionError when
    the call ended first.
    """
    try:
        first = await asyncio.wait_for(call.read(), SETTINGS_WAIT_S)
        if first is grpc.aio.EOF or not first.HasField("settings"):
            raise ConnectionError(f"{peer} ended the call before its settings")
    except BaseException:
        call.cancel()
        raise
    return first.settings


class Inbox(Generic[Event]):
    """One logical stream's mailbox: filled by the session's reader (never awaits), read by one consumer.

    Args:
        session: the call it runs on (its credit goes back through it).
        stream: its id on the call.

    """

    __slots__ = ("_closed", "_ended", "_mailbox", "_owed", "_session", "_waiter", "stream")

    stream: int
    _session: CallerSession[Any, Any]
    _mailbox: deque[Event | BaseException]
    _waiter: asyncio.Future[None] | None
    _owed: int
    """Credit taken by the consumer and not yet returned."""
    _ended: bool
    """The peer ended the stream (or the call broke): nothing more comes."""
    _closed: bool
    """The consumer let go of it."""

    def __init__(self, session: CallerSession[Any, Any], stream: int) -> None:
        self.stream = stream
        self._session = session
        self._mailbox = deque()
        self._waiter = None
        self._owed = 0
        self._ended = False
        self._closed = False

    def put(self, item: Event | BaseException, *, last: bool = False) -> None:
        """An event (or the error that ends the stream) for the consumer; wake it if it waits."""
        self._mailbox.append(item)
        if last:
            self._ended = True
        self._wake()

    def done(self) -> bool:
        """Whether the stream is over on the call."""
        return self._ended or self._closed

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _close(self) -> bool:
        """The consumer lets go: a pending take returns None. False when it had let go already."""
        if self._closed:
            return False
        self._closed = True
        self._wake()
        return True

    async def _take(self) -> Event | None:
        """The next event; raises the error that ended the stream; None once let go with nothing left."""
        if not self._mailbox:
            if self._closed:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
            if not self._mailbox:
                return None
        item = self._mailbox.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def _owe(self, cost: int) -> None:
        """The consumer took cost bytes of credit: returned once a quarter window is owed, not per event."""
        self._owed += cost
        if self._owed >= self._session.grant_at:
            self._session.grant(self.stream, self._owed)
            self._owed = 0


class Outbox(Generic[Command]):
    """Commands and credit waiting for the writer (``write_loop``), one message per write.

    Args:
        message: builds one message from (commands, credit streams, credit bytes).
        max_bytes: the commands of one message stay under this (a single larger command goes alone): an oversized
            message would end the call, and every stream on it.

    """

    max_bytes: int
    _message: Callable[[list[Command], list[int], list[int]], Any]
    _commands: list[Command]
    _credit: dict[int, int]
    _flush: asyncio.Event
    _written: asyncio.Event
    """Set while nothing waits to be written."""

    def __init__(self, message: Callable[[list[Command], list[int], list[int]], Any], max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._message = message
        self._commands = []
        self._credit = {}
        self._flush = asyncio.Event()
        self._written = asyncio.Event()
        self._written.set()

    def send(self, command: Command) -> None:
        """Queue a command for the writer's next message."""
        self._commands.append(command)
        self._pending()

    def grant(self, stream: int, credit: int) -> None:
        """Return credit to a stream in the writer's next message (added to what it is owed already)."""
        self._credit[stream] = self._credit.get(stream, 0) + credit
        self._pending()

    def forget(self, stream: int) -> None:
        """No credit for a stream let go of (its peer sends nothing more for it)."""
        self._credit.pop(stream, None)

    def clear(self) -> None:
        """The call ended: nothing queued will be written."""
        self._commands.clear()
        self._credit.clear()
        self._flush.clear()
        self._written.set()

    async def written(self) -> None:
        """Until nothing waits to be written."""
        await self._written.wait()

    def _pending(self) -> None:
        self._flush.set()
        self._written.clear()

    async def write_loop(self, call: Any) -> None:
        """Everything pending when it runs, as one message, until the call ends (the reader sees how)."""
        while True:
            await self._flush.wait()
            self._flush.clear()
            credit, self._credit = self._credit, {}
            message = self._message(self._take(), list(credit), list(credit.values()))
            if self._commands:
                self._flush.set()  # the rest goes in the next message
            try:
                await call.write(message)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                return
            if not self._flush.is_set():
                self._written.set()

    def _take(self) -> list[Command]:
        """The pending commands that fit in max_bytes (at least one)."""
        size = 0
        for taken, command in enumerate(self._commands):
            size += command.ByteSize() + FRAMING_BYTES
            if size > self.max_bytes and taken:
                batch, self._commands = self._commands[:taken], self._commands[taken:]
                return batch
        batch, self._commands = self._commands, []
        return batch


class CallerSession(Generic[Command, Stream]):
    """One open multiplexed call: its streams by id, and the commands and credit waiting for the writer.

    A subclass says what its frames are: :meth:`demux` (one message into the streams), :meth:`detached` (the
    command that lets go of a stream) and :meth:`broken` (what each stream raises when the call ends).

    Args:
        call: the call, its settings read.
        window: a stream's credit (the server end's default window).
        max_batch_bytes: the server end's bound on one message.
        message: builds one message of commands and credit columns.

    """

    call: Any  # a grpc.aio StreamStreamCall (stubs are untyped)
    streams: dict[int, Stream]
    grant_at: int
    """Credit owed by a stream that is returned in one grant: a quarter of the window."""
    outbox: Outbox[Command]
    retired: bool
    """Takes no new streams: the call is closed once the last stream on it has ended."""
    _next: int
    _open: bool

    def __init__(
        self,
        call: Any,
        window: int,
        max_batch_bytes: int,
        message: Callable[[list[Command], list[int], list[int]], Any],
    ) -> None:
        self.call = call
        self.streams = {}
        self.grant_at = max(1, window // 4)
        self.outbox = Outbox(message, max_batch_bytes)
        self.retired = False
        self._next = 0
        self._open = True

    @property
    def open(self) -> bool:
        """Whether the call still takes new streams (False once it broke or was retired)."""
        return self._open and not self.retired

    def add(self, make: Callable[[int], Stream]) -> Stream:
        """A new stream with the next id (started by the command the caller sends for it)."""
        self._next += 1
        stream = self.streams[self._next] = make(self._next)
        return stream

    def send(self, command: Command) -> None:
        """Queue a command for the writer's next message."""
        self.outbox.send(command)

    def grant(self, stream: int, credit: int) -> None:
        """Return credit to a stream in the writer's next message."""
        if stream in self.streams:
            self.outbox.grant(stream, credit)

    def detach(self, stream: int) -> None:
        """The caller let go of a stream the server has not ended: nothing more is sent for it."""
        if self.streams.pop(stream, None) is not None and self._open:
            self.outbox.forget(stream)
            self.send(self.detached(stream))
            self.freed()
        self._close_if_done()

    def retire(self) -> None:
        """No new streams come: close the call once the last one has ended."""
        self.retired = True
        self._close_if_done()

    def _close_if_done(self) -> None:
        if self.retired and not self.streams:
            self.call.cancel()  # nothing on it: the server end has nothing to let go of

    def end(self, stream: int, item: Any) -> None:
        """The server ended a stream with item (its last event, or an error)."""
        ended = self.streams.pop(stream, None)
        if ended is not None:
            ended.put(item, last=True)

    async def write_loop(self) -> None:
        """Everything pending when it runs, as one message, until the call ends (the reader fails the streams)."""
        await self.outbox.write_loop(self.call)

    async def serve(self) -> None:
        """Read and write until the call ends (raising how it broke); then every stream on it fails."""
        writer = asyncio.create_task(self.write_loop())
        failure: BaseException | None = None
        try:
            while (message := await self.call.read()) is not grpc.aio.EOF:
                self.deliver(message)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            writer.cancel()
            self.call.cancel()
            self.fail(failure)

    def fail(self, failure: BaseException | None) -> None:
        """The call ended (failure None: the peer ended it): every stream on it raises :meth:`broken`."""
        self._open = False
        self.outbox.clear()
        streams, self.streams = self.streams, {}
        for stream in streams.values():  # an exception each: raised in many tasks, one would share its traceback
            stream.put(self.broken(failure), last=True)
        self.freed()

    def freed(self) -> None:
        """Streams ended or were let go of (a subclass that bounds its streams wakes its waiting starts)."""

    def deliver(self, message: Any) -> None:
        """One message's chunks and ends into their streams' mailboxes (a stream let go of is skipped)."""
        self.demux(message)
        self.freed()
        self._close_if_done()

    def demux(self, message: Any) -> None:
        """Put each chunk and end of message into its stream (:meth:`end` for the ends)."""
        raise NotImplementedError

    def detached(self, stream: int) -> Command:
        """The command that lets go of a stream."""
        raise NotImplementedError

    def broken(self, failure: BaseException | None) -> BaseException:
        """What a stream raises when the call ended with failure (None: the peer ended it)."""
        raise NotImplementedError
