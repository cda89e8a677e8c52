"""The client's side of ``Inference/GenerateStream``: one call per router carrying every generation sent there.

A :class:`StreamSession` is one open call: one reader task that demultiplexes
each ``StreamEvents`` into the logical streams' mailboxes (it never waits
for a consumer: credit bounds every mailbox) and one writer task that sends
everything pending when it runs (starts, cancels, detaches and credit) as one
``StreamCommands``. This is the router's ``Worker/Link`` session
(:mod:`tokenmesh.router._link`) on the caller's hop.

A :class:`Stream` is read as a ``Generate`` or ``Resume`` call is (``async
for``, ``cancel()``): it yields the same chunks and raises the same
``grpc.aio.AioRpcError`` — a ``StreamEnd`` becomes the error its own call
would have ended with, status details in the trailers — so the client's
retry and resume logic does not know which it reads. When the shared call
breaks, every stream on it raises a broken-stream error (the call's
UNAVAILABLE/CANCELLED/..., without the router's details: a call that broke
was not answered for any one generation) and is resumed elsewhere.

:class:`Sessions` owns one client's sessions by router address, opens each
on first use, and remembers the routers that answered UNIMPLEMENTED (they
predate the call and get ``Generate``/``Resume`` until their channel is
renewed or the client closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc

from tokenmesh.errors import rpc_error
from tokenmesh.inbox import Inbox
from tokenmesh.outbox import Outbox
from tokenmesh.v1 import inference_pb2

log = logging.getLogger(__name__)

SETTINGS_WAIT_S = 5.0
"""How long a new call waits for the router's StreamSettings before it counts as broken."""
DEFAULT_MAX_BATCH_BYTES = 256 * 1024
"""The bound on one StreamCommands when the router's settings name none."""
DEFAULT_WINDOW_BYTES = 4096
"""A stream's credit when the router's settings name none (credit is returned per quarter of it)."""
CHUNK_OVERHEAD = 16
"""Credit a chunk costs beyond its text's bytes (as the router charges it)."""
COMMAND_MARGIN = 64
"""Bytes kept free in a StreamCommands beside one command (credit columns, framing)."""
BROKEN_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
)
"""Codes a broken call passes on to its streams as they are (any other becomes UNAVAILABLE: it is not theirs)."""

Item = inference_pb2.GenerateChunk | BaseException
"""What a stream's mailbox holds: chunks, then the error that ends the stream, if any."""
OpenCall = Callable[[str], Any]
"""Opens a GenerateStream call to a router address (a grpc.aio StreamStreamCall; stubs are untyped)."""


def broken(code: grpc.StatusCode, message: str) -> grpc.aio.AioRpcError:
    """The error a stream raises when its call broke: the code of a broken Generate call, no router details."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=message)


class Stream(Inbox[inference_pb2.GenerateChunk]):
    """One generation or resume on a GenerateStream call, iterated as a Generate or Resume call is.

    Args:
        session: the call it runs on.
        stream: its id on the call.

    """

    __slots__ = ("_closed", "_session", "_timer")

    _session: StreamSession
    _closed: bool
    """The client let go of it (cancel(), let_go() or its deadline)."""
    _timer: asyncio.TimerHandle | None

    def __init__(self, session: StreamSession, stream: int) -> None:
        super().__init__(session, stream)
        self._session = session
        self._closed = False
        self._timer = None

    # -- fed by the session's reader (never awaits) --

    def put(self, item: Item, *, last: bool = False) -> None:
        """A chunk (or the error that ends the stream) for the caller; wake it if it waits."""
        if last and self._timer is not None:
            self._timer.cancel()
        super().put(item, last=last)

    def expire_at(self, deadline: float) -> None:
        """End the stream with DEADLINE_EXCEEDED at deadline (monotonic), as a call's own deadline would."""
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(loop.time() + max(0.0, deadline - time.monotonic()), self._expire)

    def _expire(self) -> None:
        if self._ended or self._closed:
            return
        self._session.detach(self.stream)  # as a Generate call whose deadline passed: the router lets go of it
        self.put(broken(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), last=True)

    # -- the caller's side (Client._follow) --

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> inference_pb2.GenerateChunk:
        """The next chunk; raises the status or break that ended the stream; stops after the final chunk."""
        if not self._mailbox and (self._ended or self._closed):
            raise StopAsyncIteration
        item = await self._take()
        if item is None:  # let_go() woke it
            raise StopAsyncIteration
        if not item.finish_reason:  # the final chunk costs nothing, and nothing follows it
            self._owe(len(item.text.encode()) + CHUNK_OVERHEAD)
        return item

    def cancel(self) -> bool:
        """Let go, as closing a Generate call does: the router detaches it (it may run on for Resume)."""
        return self.let_go(cancel=False)

    def let_go(self, *, cancel: bool) -> bool:
        """Stop reading; with cancel, stop the generation first. False when the stream was over already."""
        if self._closed:
            return False
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        self._wake()
        if self._ended:
            return False
        if cancel:
            self._session.cancel(self.stream)
        self._session.detach(self.stream)
        return True

    def done(self) -> bool:
        """Whether the stream is over on the call."""
        return self._ended or self._closed


def _stream_commands(
    commands: list[inference_pb2.StreamCommand], credit_stream: list[int], credit_bytes: list[int]
) -> inference_pb2.StreamCommands:
    return inference_pb2.StreamCommands(commands=commands, credit_stream=credit_stream, credit_bytes=credit_bytes)


class StreamSession:
    """One open GenerateStream call: its streams by id, and the commands and credit waiting for the writer.

    Args:
        address: the router it goes to.
        call: the GenerateStream call, its settings read.
        settings: what the router announced.

    """

    address: str
    call: Any  # a grpc.aio StreamStreamCall (stubs are untyped)
    settings: inference_pb2.StreamSettings
    streams: dict[int, Stream]
    grant_at: int
    """Credit owed by a stream that is returned in one grant: a quarter of the window."""
    max_command_bytes: int
    """The largest command that goes on the call (a bigger request goes over Generate)."""
    retired: bool
    """Takes no new streams (its channel was renewed): the call is closed once the last stream on it ended."""
    _next: int
    outbox: Outbox[inference_pb2.StreamCommand]
    _open: bool
    _task: asyncio.Task[None] | None
    _slot_waiters: deque[asyncio.Future[None]]
    """Starts waiting for a stream to end while the call holds the router's max_streams."""

    def __init__(self, address: str, call: Any, settings: inference_pb2.StreamSettings) -> None:
        self.address = address
        self.call = call
        self.settings = settings
        self.streams = {}
        self.grant_at = max(1, (settings.default_window_bytes or DEFAULT_WINDOW_BYTES) // 4)
        self.max_command_bytes = (settings.max_batch_bytes or DEFAULT_MAX_BATCH_BYTES) - COMMAND_MARGIN
        self.retired = False
        self._next = 0
        self.outbox = Outbox(_stream_commands, self.max_command_bytes)
        self._open = True
        self._task = None
        self._slot_waiters = deque()

    @property
    def open(self) -> bool:
        """Whether the call still takes new streams."""
        return self._open and not self.retired

    def full(self) -> bool:
        """Whether a new start would be beyond the router's max_streams (it would refuse it)."""
        limit = self.settings.max_streams
        return bool(limit) and len(self.streams) >= limit

    async def slot(self) -> None:
        """Wait until a new stream fits in the router's max_streams (or the call ended: then check ``open``).

        Waiting keeps what one caller makes the router hold within the router's bound, as HTTP/2's
        per-connection stream limit does for Generate calls.
        """
        while self.full() and self._open:
            waiter = asyncio.get_running_loop().create_future()
            self._slot_waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._slot_waiters:
                    self._slot_waiters.remove(waiter)

    def _freed(self) -> None:
        """Streams ended: wake as many waiting starts as now fit (all of them once the call ended)."""
        room = self.settings.max_streams - len(self.streams) if self._open else len(self._slot_waiters)
        while room > 0 and self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                room -= 1

    def start(self, command: inference_pb2.StreamCommand, deadline: float | None) -> Stream:
        """A new stream for a generate or resume command (its stream id set here), queued for the writer."""
        self._next += 1
        command.stream = self._next
        stream = self.streams[self._next] = Stream(self, self._next)
        if deadline is not None:
            stream.expire_at(deadline)
        self._send(command)
        return stream

    def _send(self, command: inference_pb2.StreamCommand) -> None:
        self.outbox.send(command)

    def grant(self, stream: int, credit: int) -> None:
        """Return credit to a stream in the writer's next message."""
        if stream in self.streams:
            self.outbox.grant(stream, credit)

    def cancel(self, stream: int) -> None:
        """Stop a stream's generation (as Inference/Cancel)."""
        if stream in self.streams and self._open:
            self._send(inference_pb2.StreamCommand(stream=stream, cancel=inference_pb2.StreamCancel()))

    def detach(self, stream: int) -> None:
        """The client let go of a stream the router has not ended: nothing more is sent for it."""
        if self.streams.pop(stream, None) is not None and self._open:
            self.outbox.forget(stream)
            self._send(inference_pb2.StreamCommand(stream=stream, detach=inference_pb2.StreamDetach()))
            if self._slot_waiters:
                self._freed()
        self._close_if_done()

    def retire(self) -> None:
        """No new streams come (the router's channel was renewed): close the call once the last one has ended."""
        self.retired = True
        self._close_if_done()

    def _close_if_done(self) -> None:
        if self.retired and not self.streams:
            self.call.cancel()  # nothing on it: the router has nothing to detach

    # -- the call's two tasks --

    def serve(self) -> asyncio.Task[None]:
        """Start the reader and writer; the task ends when the call does, every stream still on it failed."""
        self._task = asyncio.create_task(self._serve(), name=f"GenerateStream {self.address}")
        return self._task

    async def _serve(self) -> None:
        writer = asyncio.create_task(self.write_loop())
        code, message = grpc.StatusCode.UNAVAILABLE, f"router {self.address} ended the GenerateStream call"
        try:
            await self.read_loop()
        except grpc.aio.AioRpcError as exc:
            code = exc.code() if exc.code() in BROKEN_CODES else grpc.StatusCode.UNAVAILABLE
            message = f"the GenerateStream call to router {self.address} broke: {exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            code, message = grpc.StatusCode.CANCELLED, "the client closed its GenerateStream call"
            raise
        finally:
            writer.cancel()
            self.call.cancel()
            self.fail(code, message)

    async def write_loop(self) -> None:
        """Everything pending when it runs, as one message, until the call ends (the reader fails the streams)."""
        await self.outbox.write_loop(self.call)

    async def read_loop(self) -> None:
        """Deliver every message to its streams until the call ends (then raise how, or return at its end)."""
        while True:
            message = await self.call.read()
            if message is grpc.aio.EOF:
                return
            self.deliver(message)

    def deliver(self, message: inference_pb2.StreamEvents) -> None:
        """One message's chunks and ends into their streams' mailboxes (a stream let go of is skipped)."""
        streams = self.streams
        for stream, chunk in zip(message.chunk_stream, message.chunks, strict=False):
            target = streams.get(stream)
            if target is None:
                continue  # detached meanwhile
            if chunk.finish_reason:
                del streams[stream]
                target.put(chunk, last=True)
            else:
                target.put(chunk)
        for end in message.ends:
            ended = streams.pop(end.stream, None)
            if ended is not None:
                ended.put(rpc_error(end.status), last=True)
        if self._slot_waiters:
            self._freed()
        if self.retired:
            self._close_if_done()

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        """The call ended: every stream on it raises a broken-stream error (each is resumed elsewhere)."""
        self._open = False
        self.outbox.clear()
        streams, self.streams = self.streams, {}
        for stream in streams.values():  # an exception each: raised in many tasks, one would share its traceback
            stream.put(broken(code, message), last=True)
        self._freed()

    async def close(self, grace_s: float = 1.0) -> None:
        """End the call and its tasks (streams on it break), once what is queued (cancels) is written or grace_s."""
        if self._open:
            # A cancel still queued would be lost with the call, and the router would keep that generation for
            # Resume (the client gives every generation an id): it goes first.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.outbox.written(), grace_s)
        self.call.cancel()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class Sessions:
    """A client's GenerateStream sessions by router address, opened on first use; routers that predate the call.

    Args:
        open_call: opens a GenerateStream call to an address (on the client's link to it).

    """

    _open_call: OpenCall
    _sessions: dict[str, StreamSession]
    _opening: dict[str, asyncio.Task[StreamSession | None]]
    _retired: set[StreamSession]
    """Sessions of replaced channels, serving the streams on them until those end."""
    unbatched: set[str]
    """Routers that answered UNIMPLEMENTED: Generate and Resume for them, until renew() or close()."""

    def __init__(self, open_call: OpenCall) -> None:
        self._open_call = open_call
        self._sessions = {}
        self._opening = {}
        self._retired = set()
        self.unbatched = set()

    async def get(self, address: str) -> StreamSession | None:
        """The router's open session, opened now if there is none; None for a router that predates the call.

        Raises the ``grpc.aio.AioRpcError`` the opening failed with (the router down: UNAVAILABLE), as a
        Generate call to it would.
        """
        if address in self.unbatched:
            return None
        session = self._sessions.get(address)
        if session is not None and session.open:
            return session
        opening = self._opening.get(address)
        if opening is None:
            # In a context of its own: the call outlives the generation that opened it, so its RPC span (tracing on)
            # is no generation's child; each stream carries its own traceparent in its start's metadata.
            opening = self._opening[address] = asyncio.create_task(self._open(address), context=contextvars.Context())
            opening.add_done_callback(lambda done: self._opened(address, done))
        try:
            return await asyncio.shield(opening)  # one opening for every generation waiting on it
        except grpc.aio.AioRpcError as exc:  # an error each: raised in many tasks, one would share its traceback
            raise grpc.aio.AioRpcError(
                exc.code(), exc.initial_metadata(), exc.trailing_metadata(), exc.details()
            ) from None

    def _opened(self, address: str, opening: asyncio.Task[StreamSession | None]) -> None:
        if self._opening.get(address) is opening:
            del self._opening[address]
        if not opening.cancelled():
            opening.exception()  # taken: its waiters (if any are left) have their own copies

    async def _open(self, address: str) -> StreamSession | None:
        call = self._open_call(address)
        try:
            first = await asyncio.wait_for(call.read(), SETTINGS_WAIT_S)
        except TimeoutError:
            call.cancel()
            raise broken(grpc.StatusCode.UNAVAILABLE, f"router {address} sent no StreamSettings") from None
        except grpc.aio.AioRpcError as exc:
            call.cancel()
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            log.info("router %s does not serve Inference/GenerateStream: one Generate call per generation", address)
            self.unbatched.add(address)
            return None
        except BaseException:
            call.cancel()
            raise
        if first is grpc.aio.EOF or not first.HasField("settings"):
            call.cancel()
            raise broken(grpc.StatusCode.UNAVAILABLE, f"router {address} ended GenerateStream before its settings")
        session = self._sessions[address] = StreamSession(address, call, first.settings)
        session.serve().add_done_callback(lambda _: self._ended(session))
        return session

    def _ended(self, session: StreamSession) -> None:
        if self._sessions.get(session.address) is session:
            del self._sessions[session.address]
        self._retired.discard(session)

    def renew(self) -> None:
        """New channels: new streams open new calls on them; streams on the old calls run to their end there."""
        self.unbatched.clear()  # asked again on the new channel (an upgrade restarts the router)
        for session in self._sessions.values():
            self._retired.add(session)
            session.retire()
        self._sessions.clear()

    async def close(self) -> None:
        """End every call (their streams break) and forget what the routers speak."""
        for opening in list(self._opening.values()):
            opening.cancel()
        sessions = [*self._sessions.values(), *self._retired]
        self._sessions.clear()
        self._retired.clear()
        self.unbatched.clear()
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)
