"""The client's side of ``Inference/GenerateStream``: one call per router carrying every generation sent there.

The caller end of :mod:`tokenmesh.mux`. A :class:`Stream` is read as a
``Generate`` or ``Resume`` call is (``async for``, ``let_go``): it yields the
same chunks and raises the same ``grpc.aio.AioRpcError`` (a ``StreamEnd``
becomes the error its own call would have ended with, status details in the
trailers), so the client's retry and resume logic does not know which it
reads. When the shared call breaks, every stream on it raises a
broken-stream error (the call's UNAVAILABLE/CANCELLED/..., without the
router's details: a call that broke was not answered for any one generation)
and is resumed elsewhere.

Which router gets a call, and when, is :mod:`tokenmesh.client._sessions`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc

from tokenmesh.errors import rpc_error
from tokenmesh.mux import BROKEN_CODES, DEFAULT_MAX_BATCH_BYTES, DEFAULT_WINDOW_BYTES, CallerSession, Inbox, cost
from tokenmesh.v1 import inference_pb2

log = logging.getLogger(__name__)

COMMAND_MARGIN = 64
"""Bytes kept free in a StreamCommands beside one command (credit columns, framing)."""

OpenCall = Callable[[str], Any]
"""Opens a GenerateStream call to a router address (a grpc.aio StreamStreamCall; stubs are untyped)."""


def broken(code: grpc.StatusCode, message: str) -> grpc.aio.AioRpcError:
    """The error a stream raises when its call broke: the code of a broken Generate call, no router details."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=message)


class Call(Protocol):
    """What one attempt reads, on either road: a stream of a GenerateStream call, or a call of its own."""

    def __aiter__(self) -> AsyncIterator[inference_pb2.GenerateChunk]:
        """The chunks; raises the status or break that ended them."""

    def let_go(self, *, cancel: bool) -> bool:
        """Stop reading; True when a cancel (if asked) went with it, False when Inference/Cancel must send it."""


class OwnCall:
    """A ``Generate`` or ``Resume`` call of its own, read as a :class:`Stream` is.

    Args:
        call: the call (a grpc.aio UnaryStreamCall).

    """

    __slots__ = ("_call",)

    def __init__(self, call: Any) -> None:
        self._call = call

    def __aiter__(self) -> AsyncIterator[inference_pb2.GenerateChunk]:
        return self._call.__aiter__()  # type: ignore[no-any-return]  # the call's own iterator: no layer per chunk

    def let_go(self, *, cancel: bool) -> bool:
        """Close the call; False: a cancel is for Inference/Cancel (the call carries none)."""
        self._call.cancel()
        return False


class Stream(Inbox[inference_pb2.GenerateChunk]):
    """One generation or resume on a GenerateStream call, iterated as a Generate or Resume call is.

    Args:
        session: the call it runs on.
        stream: its id on the call.

    """

    __slots__ = ("_timer",)

    _session: StreamSession
    _timer: asyncio.TimerHandle | None

    def __init__(self, session: StreamSession, stream: int) -> None:
        super().__init__(session, stream)
        self._timer = None

    def put(self, item: inference_pb2.GenerateChunk | BaseException, *, last: bool = False) -> None:
        """A chunk (or the error that ends the stream) for the caller; wake it if it waits."""
        if last and self._timer is not None:
            self._timer.cancel()
        super().put(item, last=last)

    def expire_at(self, deadline: float) -> None:
        """End the stream with DEADLINE_EXCEEDED at deadline (monotonic), as a call's own deadline would."""
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(loop.time() + max(0.0, deadline - time.monotonic()), self._expire)

    def _expire(self) -> None:
        if self.done():
            return
        self._session.detach(self.stream)  # as a Generate call whose deadline passed: the router lets go of it
        self.put(broken(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), last=True)

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> inference_pb2.GenerateChunk:
        """The next chunk; raises the status or break that ended the stream; stops after the final chunk."""
        if not self._mailbox and self.done():
            raise StopAsyncIteration
        item = await self._take()
        if item is None:  # let go of
            raise StopAsyncIteration
        if not item.finish_reason:  # the final chunk costs nothing, and nothing follows it
            self._owe(cost(item.text))
        return item

    def cancel(self) -> bool:
        """Let go, as closing a Generate call does: the router detaches it (it may run on for Resume)."""
        return self.let_go(cancel=False)

    def let_go(self, *, cancel: bool) -> bool:
        """Stop reading; with cancel, stop the generation first. False when the stream was over already."""
        if not self._close():
            return False
        if self._timer is not None:
            self._timer.cancel()
        if self._ended:
            return False
        if cancel:
            self._session.cancel(self.stream)
        self._session.detach(self.stream)
        return True


def _stream_commands(
    commands: list[inference_pb2.StreamCommand], credit_stream: list[int], credit_bytes: list[int]
) -> inference_pb2.StreamCommands:
    return inference_pb2.StreamCommands(commands=commands, credit_stream=credit_stream, credit_bytes=credit_bytes)


class StreamSession(CallerSession[inference_pb2.StreamCommand, Stream]):
    """One open GenerateStream call: its streams by id, and the commands and credit waiting for the writer.

    Args:
        address: the router it goes to.
        call: the GenerateStream call, its settings read.
        settings: what the router announced.

    """

    address: str
    settings: inference_pb2.StreamSettings
    max_command_bytes: int
    """The largest command that goes on the call (a bigger request goes over Generate)."""
    _task: asyncio.Task[None] | None
    _slot_waiters: deque[asyncio.Future[None]]
    """Starts waiting for a stream to end while the call holds the router's max_streams."""

    def __init__(self, address: str, call: Any, settings: inference_pb2.StreamSettings) -> None:
        self.max_command_bytes = (settings.max_batch_bytes or DEFAULT_MAX_BATCH_BYTES) - COMMAND_MARGIN
        super().__init__(
            call, settings.default_window_bytes or DEFAULT_WINDOW_BYTES, self.max_command_bytes, _stream_commands
        )
        self.address = address
        self.settings = settings
        self._task = None
        self._slot_waiters = deque()

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

    def freed(self) -> None:
        """Streams ended: wake as many waiting starts as now fit (all of them once the call ended)."""
        if not self._slot_waiters:
            return
        room = self.settings.max_streams - len(self.streams) if self._open else len(self._slot_waiters)
        while room > 0 and self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                room -= 1

    def start(self, command: inference_pb2.StreamCommand, deadline: float | None) -> Stream:
        """A new stream for a generate or resume command (its stream id set here), queued for the writer."""
        stream = self.add(lambda stream: Stream(self, stream))
        command.stream = stream.stream
        if deadline is not None:
            stream.expire_at(deadline)
        self.send(command)
        return stream

    def cancel(self, stream: int) -> None:
        """Stop a stream's generation (as Inference/Cancel)."""
        if stream in self.streams and self._open:
            self.send(inference_pb2.StreamCommand(stream=stream, cancel=inference_pb2.StreamCancel()))

    def detached(self, stream: int) -> inference_pb2.StreamCommand:
        """The client let go of a stream the router has not ended."""
        return inference_pb2.StreamCommand(stream=stream, detach=inference_pb2.StreamDetach())

    def serve_task(self) -> asyncio.Task[None]:
        """Start the reader and writer; the task ends when the call does, every stream still on it failed."""
        self._task = asyncio.create_task(self._serve(), name=f"GenerateStream {self.address}")
        return self._task

    async def _serve(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):  # every stream on it raised its own copy
            await self.serve()

    def demux(self, message: inference_pb2.StreamEvents) -> None:
        """One message's chunks and ends into their streams' mailboxes (a stream let go of is skipped)."""
        streams = self.streams
        for stream, chunk in zip(message.chunk_stream, message.chunks, strict=False):
            if chunk.finish_reason:
                self.end(stream, chunk)
            else:
                target = streams.get(stream)
                if target is not None:  # else detached meanwhile
                    target.put(chunk)
        for end in message.ends:
            self.end(end.stream, rpc_error(end.status))

    def broken(self, failure: BaseException | None) -> grpc.aio.AioRpcError:
        """The error each stream raises when the call ended (it is resumed elsewhere)."""
        if isinstance(failure, grpc.aio.AioRpcError):
            code = failure.code() if failure.code() in BROKEN_CODES else grpc.StatusCode.UNAVAILABLE
            details = f"the GenerateStream call to router {self.address} broke: {failure.code().name}: "
            return broken(code, details + str(failure.details()))
        if isinstance(failure, asyncio.CancelledError):
            return broken(grpc.StatusCode.CANCELLED, "the client closed its GenerateStream call")
        return broken(grpc.StatusCode.UNAVAILABLE, f"router {self.address} ended the GenerateStream call")

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
