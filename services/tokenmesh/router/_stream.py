"""The router's side of ``Inference/GenerateStream``: many generations on one caller's call, one message per send.

The worker's side of ``Worker/Link`` again (:mod:`tokenmesh.worker._link`),
facing the mesh's own callers: one task reads the caller's commands (starts,
cancels, detaches, credit); the handler's send loop writes. Each logical
stream is one task running the servicer's own ``Generate`` or ``Resume`` with
a :class:`StreamContext` (the command's deadline and metadata), so admission,
failover, continuation, observation and cancels are theirs, not a copy. A
task hands each chunk to its stream's pending list and marks the stream
ready; the loop takes everything ready *now* into one ``StreamEvents`` and
writes it. While that write is in flight, what the streams produce piles up:
a lone chunk leaves at once, a busy call carries one message per send, not
one per token per generation.

Backpressure is per stream: a chunk costs its UTF-8 bytes plus 16 of the
stream's credit, which the caller returns as it reads. A stream without
credit stops pulling its generation, so the router stops reading that
generation's worker attempt and the worker's record merges for it; no other
stream waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import context as otel_context

from tokenmesh.errors import (
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    MeshError,
    ResourceExhausted,
    Unavailable,
)
from tokenmesh.router._relay import Live
from tokenmesh.v1 import inference_pb2
from tokenmesh.wake import Wake

log = logging.getLogger(__name__)

PROTOCOL = 1
"""The GenerateStream protocol this router speaks (StreamSettings.protocol)."""


def settings(max_streams: int) -> inference_pb2.StreamSettings:
    """What the router announces on every GenerateStream call.

    max_streams is --max-streams-per-connection's bound: one caller connection holds no more generations on one
    call than on as many Generate calls.
    """
    return inference_pb2.StreamSettings(
        protocol=PROTOCOL,
        default_window_bytes=DEFAULTS.default_window_bytes,
        max_batch_bytes=DEFAULTS.max_batch_bytes,
        max_streams=max_streams,
    )


DEFAULTS = inference_pb2.StreamSettings(
    protocol=PROTOCOL,
    # What an HTTP/2 stream's default window lets a Generate caller have in flight (64 KiB): as much ahead of the
    # caller as before, per stream.
    default_window_bytes=64 * 1024,
    # A big message delays every stream behind it on the one HTTP/2 stream by its transfer time.
    max_batch_bytes=256 * 1024,
    max_streams=10_000,
)

CHUNK_OVERHEAD = 16
"""Credit a chunk costs beyond its text's bytes, so that empty chunks cost something too."""

UNLIMITED = 2**62
"""The credit of every stream once the caller half-closed (it can return none any more)."""


class StreamContext:
    """What ``Generate`` and ``Resume`` use of their call's context, for one logical stream of a GenerateStream call.

    Args:
        call: the GenerateStream call (its deadline bounds every stream).
        metadata: the command's metadata, merged over the call's (e.g. the stream's own ``traceparent``).
        timeout_s: the stream's own deadline in seconds from now (0: only the call's).

    """

    __slots__ = ("_call", "_deadline", "_metadata", "cancel_asked", "request_id")

    request_id: str
    """The generation's request_id, once known ('' before: a Generate that has not been admitted yet)."""
    cancel_asked: bool
    """A cancel command came before the generation began: it is cancelled as it begins."""
    _call: grpc.aio.ServicerContext[Any, Any]
    _metadata: tuple[tuple[str, Any], ...]
    _deadline: float | None

    def __init__(self, call: grpc.aio.ServicerContext[Any, Any], metadata: dict[str, str], timeout_s: float) -> None:
        merged = {key: value for key, value in call.invocation_metadata() or ()}
        merged.update(metadata)
        self._call = call
        self._metadata = tuple(merged.items())
        self._deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        self.request_id = ""
        self.cancel_asked = False

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        """The call's metadata with the stream's own over it."""
        return self._metadata

    def time_remaining(self) -> float | None:
        """Seconds left before the stream's deadline or the call's, whichever is nearer (None: no deadline)."""
        call = self._call.time_remaining()
        if self._deadline is None:
            return call
        mine = max(0.0, self._deadline - time.monotonic())
        return mine if call is None else min(mine, call)

    def began(self, request_id: str, live: Live) -> None:
        """Generate admitted the stream's generation: a cancel command from now on is a Cancel of request_id."""
        self.request_id = request_id
        if self.cancel_asked:
            live.cancel()


Source = Callable[[inference_pb2.StreamCommand, StreamContext], AsyncIterator[inference_pb2.GenerateChunk]]
"""Runs a start command's generate or resume (the servicer's Generate or Resume) with the stream's context."""
Cancel = Callable[[StreamContext], Any]
"""A cancel command: Inference/Cancel for the stream's generation (a coroutine)."""


@dataclass(eq=False)
class Logical:
    """One logical stream of a GenerateStream call: its task, its credit, and what waits to be sent."""

    stream: int
    context: StreamContext
    window: int
    """The credit it started with. A chunk larger than the credit left may go while that is at least 3/4 of the
    window: the caller keeps back less than a quarter of it unreturned, so a large chunk cannot wait for ever."""
    credit: int
    timeout_s: float
    pending: list[inference_pb2.GenerateChunk] = field(default_factory=list)
    """Chunks handed over (credit charged), not yet taken into a message."""
    end: inference_pb2.StreamEnd | None = None
    """The status it ends with, sent after its pending chunks."""
    task: asyncio.Task[None] | None = None
    granted: asyncio.Future[None] | None = None
    """Set while its task waits for credit."""
    expired: bool = False
    """Its own deadline passed (its task was cancelled for it)."""


def _urgent(logical: Logical) -> bool:
    """What a linger must not hold: a generation's first chunk, its final chunk, or its end."""
    pending = logical.pending
    return logical.end is not None or bool(pending and (pending[0].seq == 1 or pending[-1].finish_reason))


class StreamSession:
    """One ``Inference/GenerateStream`` call: its streams by id, the ready set, and the send loop.

    Args:
        call: the call's context.
        source: runs a stream's generate or resume as Generate and Resume do.
        cancel: what a cancel command does.
        opened: told +1 when a stream opens and -1 when it is over on the call (the router's drain waits for 0).
        draining: whether the router drains (the call ends once its streams have).
        sent: told the number of chunks of each message taken to be sent (the router's metrics).
        announced: the call's settings (sent first).
        linger_s: how long a send may wait for more of its streams to have a chunk, while the call is busy (see
            ``_should_linger``; 0: never).

    """

    streams: dict[int, Logical]
    ready: dict[int, Logical]
    """Streams with something to take, in the order they became ready (a dict as an ordered set)."""
    ends: list[inference_pb2.StreamEnd]
    """Ends of streams that never started (refused ids), for the next message."""
    last_stream: int
    """The highest stream id started: ids increase and are never reused on a call."""
    closing: bool
    """The caller half-closed: the call ends once every stream has."""
    tasks: set[asyncio.Task[None]]
    """Every stream's task and every cancel still running (cancelled when the call ends)."""
    _call: grpc.aio.ServicerContext[Any, Any]
    _source: Source
    _cancel: Cancel
    _opened: Callable[[int], None]
    _draining: Callable[[], bool]
    _sent: Callable[[int], None]
    _wake: Wake
    """The send loop's wait; while it lingers, a stream that becomes ready wakes it only once every stream is."""
    linger_s: float
    _last_send: float
    """time.monotonic() of the latest message taken."""

    def __init__(
        self,
        call: grpc.aio.ServicerContext[Any, Any],
        source: Source,
        cancel: Cancel,
        opened: Callable[[int], None],
        draining: Callable[[], bool],
        sent: Callable[[int], None] = lambda _: None,
        announced: inference_pb2.StreamSettings = DEFAULTS,
        linger_s: float = 0.0,
    ) -> None:
        self.settings = announced
        self.linger_s = linger_s
        self._last_send = 0.0
        self._call = call
        self._source = source
        self._cancel = cancel
        self._opened = opened
        self._draining = draining
        self._sent = sent
        self.streams = {}
        self.ready = {}
        self.ends = []
        self.last_stream = 0
        self.closing = False
        self.tasks = set()
        self._wake = Wake()

    async def run(
        self, commands: AsyncIterator[inference_pb2.StreamCommands]
    ) -> AsyncIterator[inference_pb2.StreamEvents]:
        """The settings, then one message per send until the caller half-closes and every stream ended.

        When the call ends otherwise (the caller cancelled it or went away), every stream's task is cancelled, as
        if each Generate call had broken: a generation with a caller-given request_id runs on for Resume.
        """
        reader = asyncio.create_task(self._read(commands))
        reader.add_done_callback(lambda _: self.kick())
        try:
            yield inference_pb2.StreamEvents(settings=self.settings)
            while True:
                if reader.done():
                    reader.result()  # a message that did not parse ends the call with its status
                if self._should_linger():
                    await self._wake.linger(self.linger_s)
                message = self._take()
                if message is not None:
                    self._last_send = time.monotonic()
                    yield message  # the one await: meanwhile the streams' chunks pile up for the next message
                    continue
                if not self.streams and not self.ends:
                    if reader.done():
                        return
                    if self._draining():
                        raise Unavailable(
                            "this router is draining (shutting down) and this call's streams have ended; "
                            "open the call on another router",
                            reason="ROUTER_DRAINING",
                        )
                await self._wake.idle()
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # raised above already, where it mattered
                await reader
            for logical in list(self.streams.values()):
                self._drop(logical)
            for task in self.tasks:
                task.cancel()

    def _should_linger(self) -> bool:
        """Whether this send should wait a little for more streams' chunks (batches of one cost a message each).

        Only while the call is busy (its previous message left less than the linger ago: at a message rate where
        a send per chunk is what costs), when 2 or more streams are open and fewer are ready, and nothing urgent
        waits: a generation's first chunk (its TTFT), a final chunk or an end go at once, as does everything on a
        quiet call or with a lone stream.
        """
        return (
            self.linger_s > 0
            and bool(self.ready)
            and 2 <= len(self.streams) > len(self.ready)
            and not self.ends
            and time.monotonic() - self._last_send < self.linger_s
            and not any(_urgent(logical) for logical in self.ready.values())
        )

    def kick(self) -> None:
        """Wake the send loop if it is idle (something to take, the commands ended, or the router drains)."""
        self._wake.kick()

    def _mark(self, logical: Logical) -> None:
        self.ready[logical.stream] = logical
        if not self._wake.lingering or len(self.ready) >= len(self.streams) or _urgent(logical):
            self.kick()

    # -- commands -------------------------------------------------------------------------------------------------

    async def _read(self, commands: AsyncIterator[inference_pb2.StreamCommands]) -> None:
        async for message in commands:
            for command in message.commands:
                self._apply(command)
            for stream, credit in zip(message.credit_stream, message.credit_bytes, strict=False):
                logical = self.streams.get(stream)
                if logical is not None:  # unknown: a grant racing the stream's end
                    logical.credit += credit
                    self._grant(logical)
        self._close()

    def _close(self) -> None:
        """The caller half-closed: it can return no more credit, so none limits the streams' rest any longer."""
        self.closing = True
        for logical in self.streams.values():
            logical.window = logical.credit = UNLIMITED
            self._grant(logical)

    @staticmethod
    def _grant(logical: Logical) -> None:
        if logical.granted is not None and not logical.granted.done():
            logical.granted.set_result(None)

    def _apply(self, command: inference_pb2.StreamCommand) -> None:
        kind = command.WhichOneof("command")
        if kind in ("generate", "resume"):
            self._start(command)
            return
        logical = self.streams.get(command.stream)
        if logical is None:
            return  # a cancel or detach racing the stream's end (or a command kind of a later protocol)
        if kind == "cancel":
            if logical.task is not None and not logical.task.done():  # else its end is on its way already
                self._spawn(self._cancel(logical.context))  # it ends with a final chunk, CANCELLED
        elif kind == "detach":
            self._drop(logical)  # nothing more is sent for it

    def _start(self, command: inference_pb2.StreamCommand) -> None:
        stream = command.stream
        try:
            if stream <= self.last_stream:
                live = self.streams.get(stream)
                if live is not None:
                    self._drop(live)
                raise InvalidArgument(
                    f"commands.stream {stream} is not above {self.last_stream}: "
                    "stream ids are > 0 and increase on a call (never reused)",
                    field="commands.stream",
                )
            self.last_stream = stream
            timeout_s = command.timeout_s
            if not math.isfinite(timeout_s) or timeout_s < 0:
                raise InvalidArgument(
                    f"commands.timeout_s must be a number of seconds >= 0 (0: none), got {timeout_s:g}",
                    field="commands.timeout_s",
                )
            if len(self.streams) >= self.settings.max_streams:
                raise ResourceExhausted(
                    f"this call carries {self.settings.max_streams} streams already; wait for one to end, or open "
                    "another call",
                    reason="STREAMS_EXHAUSTED",
                )
        except MeshError as error:
            self.ends.append(inference_pb2.StreamEnd(stream=stream, status=error.status()))
            self.kick()
            return
        window = command.window_bytes or self.settings.default_window_bytes
        context = StreamContext(self._call, dict(command.metadata), timeout_s)
        if command.HasField("resume"):
            context.request_id = command.resume.request_id
        logical = Logical(stream, context, window, window, timeout_s)
        self.streams[stream] = logical
        self._opened(1)
        logical.task = self._spawn(self._pump(logical, command))

    def _spawn(self, work: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def _drop(self, logical: Logical) -> None:
        """The stream is over on this call (ended, detached, or the call is): its task is cancelled if it runs."""
        if self.streams.pop(logical.stream, None) is None:
            return
        self.ready.pop(logical.stream, None)
        if logical.task is not None:
            logical.task.cancel()  # as a Generate call that broke (a no-op once the task is done)
        self._opened(-1)

    # -- one stream's task ------------------------------------------------------------------------------------------

    async def _pump(self, logical: Logical, command: inference_pb2.StreamCommand) -> None:
        """Run the stream's generation, hand its chunks over within its credit; its error becomes its StreamEnd."""
        # Its generation's span takes the stream's context (its metadata), not the call's: the call's RPC span may
        # live for hours and is no generation's parent.
        otel_context.attach(otel_context.Context())
        timer = None
        if logical.timeout_s:
            timer = asyncio.get_running_loop().call_later(logical.timeout_s, self._expire, logical)
        try:
            await self._follow(logical, self._source(command, logical.context))
        except MeshError as error:
            self._end(logical, error)
        except asyncio.CancelledError:
            if not logical.expired:
                raise
            self._end(logical, DeadlineExceeded(f"stream {logical.stream}: deadline exceeded"))
        except Exception as exc:
            log.exception("stream %d of a GenerateStream call failed", logical.stream)
            self._end(logical, Internal(f"the router failed the stream: unexpected {type(exc).__name__}"))
        finally:
            if timer is not None:
                timer.cancel()

    async def _follow(self, logical: Logical, source: AsyncIterator[inference_pb2.GenerateChunk]) -> None:
        """Hand every chunk of source over; a chunk waits for credit (the generation waits with it)."""
        final = False
        async with contextlib.aclosing(source):  # type: ignore[type-var]  # an async generator
            async for piece in source:
                if piece.finish_reason:
                    final = True  # costs nothing; the generation returns right after it
                else:
                    cost = len(piece.text.encode()) + CHUNK_OVERHEAD
                    while cost > logical.credit and logical.credit < logical.window - logical.window // 4:
                        await self._credit(logical)
                    logical.credit -= cost
                if logical.stream in self.streams:
                    logical.pending.append(piece)
                    self._mark(logical)
        if not final:
            raise Internal("the generation ended without a final chunk")

    @staticmethod
    async def _credit(logical: Logical) -> None:
        logical.granted = asyncio.get_running_loop().create_future()
        try:
            await logical.granted
        finally:
            logical.granted = None

    def _expire(self, logical: Logical) -> None:
        if logical.task is not None and not logical.task.done():
            logical.expired = True
            logical.task.cancel()

    def _end(self, logical: Logical, error: MeshError) -> None:
        if logical.stream in self.streams:
            logical.end = inference_pb2.StreamEnd(stream=logical.stream, status=error.status())
            self._mark(logical)

    # -- the send loop's take ---------------------------------------------------------------------------------------

    def _take(self) -> inference_pb2.StreamEvents | None:
        """Everything ready now, within the message's budget, as one message."""
        if not self.ready and not self.ends:
            return None
        budget = self.settings.max_batch_bytes
        streams: list[int] = []
        chunks: list[inference_pb2.GenerateChunk] = []
        ends, self.ends = self.ends, []
        ready, self.ready = self.ready, {}
        for logical in ready.values():
            pending = logical.pending
            taken = 0
            for piece in pending:
                size = piece.ByteSize()
                if size > budget and (chunks or ends):
                    break
                budget -= size
                streams.append(logical.stream)
                chunks.append(piece)
                taken += 1
            if taken < len(pending):
                del pending[:taken]
                self.ready[logical.stream] = logical  # the budget ran out: first in the next message
                continue
            final = taken > 0 and pending[-1].finish_reason
            pending.clear()
            if final:
                self._drop(logical)  # its final chunk: nothing follows
            elif logical.end is not None:
                ends.append(logical.end)
                self._drop(logical)
        if not chunks and not ends:
            return None
        events = inference_pb2.StreamEvents(chunks=chunks, ends=ends)
        events.chunk_stream.extend(streams)
        self._sent(len(chunks))
        return events
