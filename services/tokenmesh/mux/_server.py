"""The server end of a multiplexed call: one task reads the commands, the handler's send loop writes.

A stream with something to send is marked ready; the send loop takes
everything ready *now* into one message and writes it. While that write is in
flight, what the streams produce piles up for the next message: a lone chunk
leaves at once, a busy call carries one message per send, not one per token
per stream. No timer, no batch to fill.

Linger (off at 0): with streams on their own phases a send often holds one
chunk (batches of one, a gRPC message each). With 2 or more streams on the
call and fewer of them ready, a send may wait up to the linger for the rest;
it goes at once when every stream is ready or something urgent waits (a
refusal, a stream's first or last event: its TTFT, its end). Which sends
linger beyond that is each side's :meth:`ServerSession.busy`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from tokenmesh.errors import Internal, InvalidArgument, MeshError, ResourceExhausted
from tokenmesh.mux._wire import UNLIMITED

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Served:
    """One logical stream at the server end: its id and its credit."""

    stream: int
    window: int
    """The credit it started with (see :func:`tokenmesh.mux.fits`)."""
    credit: int


S = TypeVar("S", bound=Served)


@dataclass
class Batch:
    """One message being filled, column by column (a few extend() calls per message, not a message per frame)."""

    budget: int
    """Bytes left in the message."""
    ends: list[Any]
    streams: list[int] = field(default_factory=list)
    """The stream of each chunk taken."""

    def full(self, size: int) -> bool:
        """Whether size does not fit any more (a single larger item goes alone)."""
        return size > self.budget and bool(self.streams or self.ends)


class Wake:
    """One send loop's wait: ``idle`` until ``kick``, or ``linger`` until ``kick`` or the bound."""

    lingering: bool
    """A linger is in progress (a stream that becomes ready kicks only if the side's rule says so)."""
    _future: asyncio.Future[None] | None

    def __init__(self) -> None:
        self.lingering = False
        self._future = None

    async def idle(self) -> None:
        """Wait until kicked (a future, no timer)."""
        self._future = asyncio.get_running_loop().create_future()
        try:
            await self._future
        finally:
            self._future = None

    async def linger(self, seconds: float) -> None:
        """Wait until kicked, or seconds have passed (one timer, not a sleep per stream)."""
        loop = asyncio.get_running_loop()
        self._future = loop.create_future()
        self.lingering = True
        timer = loop.call_later(seconds, self.kick)
        try:
            await self._future
        finally:
            timer.cancel()
            self.lingering = False
            self._future = None

    def kick(self) -> None:
        """End the wait in progress, if any."""
        if self._future is not None and not self._future.done():
            self._future.set_result(None)


class ServerSession(Generic[S]):
    """One multiplexed call at its server end: its streams by id, the ready set, and the send loop.

    A subclass says what is its own: :meth:`start` (a stream from a start command), :meth:`cancel`,
    :meth:`released` (a stream is over on the call), :meth:`take_stream` (one ready stream into the message being
    filled), :meth:`urgent` (what a linger must not hold) and :meth:`granted` (credit came).

    Args:
        settings: the call's settings (sent first; their max_streams bounds the call).
        events: the server's message type (``settings`` and ``ends`` fields).
        end: the message type of a stream's end (``stream`` and ``status`` fields).
        linger_s: how long a send may wait for more of its streams to be ready (0: never).

    """

    START: frozenset[str] = frozenset({"start"})
    """The command kinds that start a stream."""
    streams: dict[int, S]
    ready: dict[int, S]
    """Streams with something to take, in the order they became ready (a dict as an ordered set)."""
    ends: list[Any]
    """Ends of streams that never started (refusals), for the next message."""
    last_stream: int
    """The highest stream id started: ids increase and are never reused on a call."""
    closing: bool
    """The caller half-closed: the call ends once every stream has."""
    held: int
    """Streams that will not be ready within a linger (a side's pacing): a linger does not wait for them."""
    settings: Any
    linger_s: float
    _events: type[Any]
    _end_type: type[Any]
    _wake: Wake
    """The send loop's wait; while it lingers, a stream that becomes ready wakes it only once every stream is."""

    def __init__(self, settings: Any, events: type[Any], end: type[Any], *, linger_s: float = 0.0) -> None:
        self.settings = settings
        self._events = events
        self._end_type = end
        self.linger_s = linger_s
        self.streams = {}
        self.ready = {}
        self.ends = []
        self.last_stream = 0
        self.closing = False
        self.held = 0
        self._wake = Wake()

    async def run(self, commands: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """The settings, then one message per send until the caller half-closes and every stream ended.

        When the call ends otherwise (the caller cancelled it or went away), every stream is released as a
        dropped call of its own would be (:meth:`released`).
        """
        reader = asyncio.create_task(self._read(commands))
        reader.add_done_callback(lambda _: self._wake.kick())
        try:
            yield self._events(settings=self.settings)
            while True:
                if reader.done():
                    reader.result()  # a message that did not parse ends the call with its status
                if self._should_linger():
                    await self._wake.linger(self.linger_s)
                message = self._take()
                if message is not None:
                    yield message  # the one await: meanwhile what the streams produce piles up for the next
                    continue
                if not self.streams and not self.ends:
                    if reader.done():
                        return
                    self.idle()
                await self._wake.idle()
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # raised above already, where it mattered
                await reader
            for served in list(self.streams.values()):
                self.drop(served)

    def _should_linger(self) -> bool:
        return (
            self.linger_s > 0
            and bool(self.ready)
            and 2 <= len(self.streams) > len(self.ready) + self.held
            and not self.ends
            and self.busy()
            and not any(self.urgent(served) for served in self.ready.values())
        )

    def kick(self) -> None:
        """Wake the send loop if it waits (something to take, the commands ended, or the service drains)."""
        self._wake.kick()

    def mark(self, served: S) -> None:
        """The stream has something to take: ready, and the loop awake unless it lingers for the others."""
        self.ready[served.stream] = served
        if not self._wake.lingering or len(self.ready) + self.held >= len(self.streams) or self.urgent(served):
            self._wake.kick()

    async def _read(self, commands: AsyncIterator[Any]) -> None:
        async for message in commands:
            for command in message.commands:
                self._apply(command)
            for stream, credit in zip(message.credit_stream, message.credit_bytes, strict=False):
                served = self.streams.get(stream)
                if served is not None:  # unknown: a grant racing the stream's end
                    served.credit += credit
                    self.granted(served)
        # Half-closed: the caller can return no more credit, so none limits the streams' rest any longer.
        self.closing = True
        for served in self.streams.values():
            served.window = served.credit = UNLIMITED
            self.granted(served)

    def _apply(self, command: Any) -> None:
        kind = command.WhichOneof("command")
        if kind in self.START:
            self._start(command)
            return
        served = self.streams.get(command.stream)
        if served is None:
            return  # a cancel or detach racing the stream's end (or a command kind of a later protocol)
        if kind == "cancel":
            self.cancel(served)
        elif kind == "detach":
            self.drop(served)  # nothing more is sent for it

    def _start(self, command: Any) -> None:
        stream = command.stream
        try:
            if stream <= self.last_stream:
                live = self.streams.get(stream)
                if live is not None:
                    self.drop(live)
                raise InvalidArgument(
                    f"commands.stream {stream} is not above {self.last_stream}: "
                    "stream ids are > 0 and increase on a call (never reused)",
                    field="commands.stream",
                )
            self.last_stream = stream
            if len(self.streams) >= self.settings.max_streams:
                raise ResourceExhausted(
                    f"this call carries {self.settings.max_streams} streams already; wait for one to end, or open "
                    "another call",
                    reason="STREAMS_EXHAUSTED",
                )
            served = self.start(command)
        except Exception as exc:  # one bad start ends its own stream, never the call's other streams
            error = exc if isinstance(exc, MeshError) else Internal(f"could not start it: {exc!r}")
            if error is not exc:
                log.exception("start of stream %d failed", stream)
            self.ends.append(self.end_of(stream, error))
            self._wake.kick()
            return
        self.streams[stream] = served

    def drop(self, served: S) -> None:
        """The stream is over on this call (ended, detached, or the call is): released once."""
        if self.streams.pop(served.stream, None) is None:
            return
        self.ready.pop(served.stream, None)
        self.released(served)

    def end_of(self, stream: int, error: MeshError) -> Any:
        """The end message of a stream that ends with error (a refused start, or a stream's own failure)."""
        return self._end_type(stream=stream, status=error.status())

    def _take(self) -> Any:
        """Everything ready now, within each stream's credit and the message's budget, as one message (or None)."""
        if not self.ready and not self.ends:
            return None
        batch = self.batch(self.settings.max_batch_bytes, self.ends)
        self.ends = []
        ready, self.ready = self.ready, {}
        for served in ready.values():
            if self.take_stream(served, batch):
                self.ready[served.stream] = served  # the budget ran out: first in the next message
        return self.message(batch)

    # -- what each side says ------------------------------------------------------------------------------------

    def start(self, command: Any) -> S:
        """A stream for a start command (or raise the MeshError that refuses it)."""
        raise NotImplementedError

    def cancel(self, served: S) -> None:
        """A cancel command for a live stream."""
        raise NotImplementedError

    def released(self, served: S) -> None:
        """The stream is over on this call."""
        raise NotImplementedError

    def batch(self, budget: int, ends: list[Any]) -> Batch:
        """An empty message being filled, with the refusals' ends."""
        raise NotImplementedError

    def take_stream(self, served: S, batch: Any) -> bool:
        """Move the stream's ready events into batch; True when the budget stopped it with more to take."""
        raise NotImplementedError

    def message(self, batch: Any) -> Any:
        """The message for a filled batch (None when nothing was taken)."""
        raise NotImplementedError

    def urgent(self, served: S) -> bool:
        """Whether a linger must not hold the stream (its first event, or its end)."""
        raise NotImplementedError

    def granted(self, served: S) -> None:
        """Credit came for the stream."""
        raise NotImplementedError

    def busy(self) -> bool:
        """Whether a send may linger at all now (beyond the stream counts)."""
        return True

    def idle(self) -> None:
        """No stream is open and the caller has not half-closed (raise to end the call)."""
