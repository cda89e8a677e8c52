"""The router's side of ``Inference/GenerateStream``: many generations on one caller's call, one message per send.

The server end of :mod:`tokenmesh.mux`, facing the mesh's own callers. Each
logical stream is one task running the servicer's own generate or resume
with a :class:`StreamContext` (the command's deadline and metadata), so
admission, failover, continuation, observation and cancels are theirs, not a
copy. A task hands each chunk to its stream's pending list and marks the
stream ready; the send loop takes everything ready *now* into one
``StreamEvents``.

Backpressure is per stream: a stream without credit stops pulling its
generation, so the router stops reading that generation's worker attempt and
the worker's record merges for it; no other stream waits.
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

from tokenmesh.errors import DeadlineExceeded, Internal, InvalidArgument, MeshError, Unavailable
from tokenmesh.mux import DEFAULT_MAX_BATCH_BYTES, MAX_STREAMS, PROTOCOL, Batch, Served, ServerSession, cost, fits
from tokenmesh.router._live import Live
from tokenmesh.v1 import inference_pb2

log = logging.getLogger(__name__)


def settings(max_streams: int = MAX_STREAMS) -> inference_pb2.StreamSettings:
    """What the router announces on every GenerateStream call.

    max_streams is --max-streams-per-connection's bound: one caller connection holds no more generations on one
    call than on as many Generate calls.
    """
    return inference_pb2.StreamSettings(
        protocol=PROTOCOL,
        # What an HTTP/2 stream's default window lets a Generate caller have in flight (64 KiB): as much ahead of the
        # caller as before, per stream.
        default_window_bytes=64 * 1024,
        max_batch_bytes=DEFAULT_MAX_BATCH_BYTES,
        max_streams=max_streams,
    )


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
"""Runs a start command's generate or resume (the servicer's own) with the stream's context."""


@dataclass(frozen=True)
class Streams:
    """What a GenerateStream call's streams do in the router, given by the servicer."""

    source: Source
    """Runs a stream's generate or resume."""
    cancel: Callable[[StreamContext], Any]
    """A cancel command: Inference/Cancel for the stream's generation (a coroutine)."""
    opened: Callable[[int], None]
    """Told +1 when a stream opens and -1 when it is over on the call (the router's drain waits for 0)."""
    draining: Callable[[], bool]
    """Whether the router drains (the call ends once its streams have)."""
    sent: Callable[[int], None] = lambda _: None
    """Told the number of chunks of each message taken to be sent (the router's metrics)."""


@dataclass(eq=False)
class Logical(Served):
    """One logical stream of a GenerateStream call: its task, and what waits to be sent."""

    context: StreamContext = field(kw_only=True)
    timeout_s: float = field(kw_only=True)
    pending: list[inference_pb2.GenerateChunk] = field(default_factory=list)
    """Chunks handed over (credit charged), not yet taken into a message."""
    end: inference_pb2.StreamEnd | None = None
    """The status it ends with, sent after its pending chunks."""
    task: asyncio.Task[None] | None = None
    granted: asyncio.Future[None] | None = None
    """Set while its task waits for credit."""
    expired: bool = False
    """Its own deadline passed (its task was cancelled for it)."""


@dataclass
class Chunks(Batch):
    """One StreamEvents being filled."""

    chunks: list[inference_pb2.GenerateChunk] = field(default_factory=list)


class StreamSession(ServerSession[Logical]):
    """One ``Inference/GenerateStream`` call: a task per stream running the servicer's generate or resume.

    Args:
        call: the call's context.
        streams: what its streams do in the router.
        announced: the call's settings (sent first).
        linger_s: how long a send may wait for more of its streams to have a chunk, while the call is busy (see
            :meth:`busy`; 0: never).

    """

    START = frozenset({"generate", "resume"})
    tasks: set[asyncio.Task[None]]
    """Every stream's task and every cancel still running (cancelled when the call ends)."""
    _call: grpc.aio.ServicerContext[Any, Any]
    _hooks: Streams
    _last_send: float
    """time.monotonic() of the latest message taken."""

    def __init__(
        self,
        call: grpc.aio.ServicerContext[Any, Any],
        streams: Streams,
        announced: inference_pb2.StreamSettings | None = None,
        linger_s: float = 0.0,
    ) -> None:
        super().__init__(
            announced or settings(), inference_pb2.StreamEvents, inference_pb2.StreamEnd, linger_s=linger_s
        )
        self._call = call
        self._hooks = streams
        self._last_send = 0.0
        self.tasks = set()

    async def run(self, commands: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """The server end's loop; when the call ends, every stream's task is cancelled (as a broken Generate call).

        A generation with a caller-given request_id runs on for Resume.
        """
        try:
            async for message in super().run(commands):
                yield message
        finally:
            for task in self.tasks:
                task.cancel()

    def busy(self) -> bool:
        """Linger only while the previous message left less than the linger ago.

        That is, at a message rate where a send per chunk is what costs; a quiet call sends at once.
        """
        return time.monotonic() - self._last_send < self.linger_s

    def idle(self) -> None:
        """No stream is open: a draining router ends the call."""
        if self._hooks.draining():
            raise Unavailable(
                "this router is draining (shutting down) and this call's streams have ended; "
                "open the call on another router",
                reason="ROUTER_DRAINING",
            )

    @staticmethod
    def urgent(served: Logical) -> bool:
        """A generation's first chunk, its final chunk, or its end."""
        pending = served.pending
        return served.end is not None or bool(pending and (pending[0].seq == 1 or pending[-1].finish_reason))

    @staticmethod
    def granted(served: Logical) -> None:
        """Wake the stream's task if it waits for credit."""
        if served.granted is not None and not served.granted.done():
            served.granted.set_result(None)

    def cancel(self, served: Logical) -> None:
        """Inference/Cancel of the stream's generation (it ends with a final chunk, CANCELLED)."""
        if served.task is not None and not served.task.done():  # else its end is on its way already
            self._spawn(self._hooks.cancel(served.context))

    def start(self, command: inference_pb2.StreamCommand) -> Logical:
        """The stream's task, running its generate or resume within its own deadline."""
        timeout_s = command.timeout_s
        if not math.isfinite(timeout_s) or timeout_s < 0:
            raise InvalidArgument(
                f"commands.timeout_s must be a number of seconds >= 0 (0: none), got {timeout_s:g}",
                field="commands.timeout_s",
            )
        window = command.window_bytes or self.settings.default_window_bytes
        context = StreamContext(self._call, dict(command.metadata), timeout_s)
        if command.HasField("resume"):
            context.request_id = command.resume.request_id
        logical = Logical(command.stream, window, window, context=context, timeout_s=timeout_s)
        self._hooks.opened(1)
        logical.task = self._spawn(self._pump(logical, command))
        return logical

    def _spawn(self, work: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def released(self, served: Logical) -> None:
        """Its task is cancelled if it runs (as a Generate call that broke)."""
        if served.task is not None:
            served.task.cancel()
        self._hooks.opened(-1)

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
            await self._follow(logical, self._hooks.source(command, logical.context))
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
                    size = cost(piece.text)
                    while not fits(size, logical.credit, logical.window):
                        await self._credit(logical)
                    logical.credit -= size
                if logical.stream in self.streams:
                    logical.pending.append(piece)
                    self.mark(logical)
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
            logical.end = self.end_of(logical.stream, error)
            self.mark(logical)

    # -- the send loop's take ---------------------------------------------------------------------------------------

    def batch(self, budget: int, ends: list[inference_pb2.StreamEnd]) -> Chunks:
        """An empty StreamEvents being filled."""
        return Chunks(budget, ends)

    def take_stream(self, served: Logical, batch: Chunks) -> bool:
        """Its pending chunks within the budget; then its final chunk or its end lets go of it."""
        pending = served.pending
        taken = 0
        for piece in pending:
            size = piece.ByteSize()
            if batch.full(size):
                break
            batch.budget -= size
            batch.streams.append(served.stream)
            batch.chunks.append(piece)
            taken += 1
        if taken < len(pending):
            del pending[:taken]
            return True
        final = taken > 0 and pending[-1].finish_reason
        pending.clear()
        if final:
            self.drop(served)  # its final chunk: nothing follows
        elif served.end is not None:
            batch.ends.append(served.end)
            self.drop(served)
        return False

    def message(self, batch: Chunks) -> inference_pb2.StreamEvents | None:
        """The message, or None when nothing was taken."""
        if not batch.chunks and not batch.ends:
            return None
        events = inference_pb2.StreamEvents(chunks=batch.chunks, ends=batch.ends)
        events.chunk_stream.extend(batch.streams)
        self._hooks.sent(len(batch.chunks))
        self._last_send = time.monotonic()
        return events


class StreamCalls:
    """The router's GenerateStream calls now open, each a :class:`StreamSession` over the same :class:`Streams`.

    Args:
        streams: what their streams do in the router.
        announced: what each call announces.
        linger_s: how long a send may wait for more streams to have a chunk (``--stream-linger-us``).

    """

    calls: set[StreamSession]
    _streams: Streams
    _announced: inference_pb2.StreamSettings
    _linger_s: float

    def __init__(self, streams: Streams, announced: inference_pb2.StreamSettings, linger_s: float) -> None:
        self.calls = set()
        self._streams = streams
        self._announced = announced
        self._linger_s = linger_s

    async def serve(
        self, commands: AsyncIterator[inference_pb2.StreamCommands], call: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[inference_pb2.StreamEvents]:
        """One call's messages, from its settings to its end."""
        session = StreamSession(call, self._streams, self._announced, self._linger_s)
        self.calls.add(session)
        try:
            async for message in session.run(commands):
                yield message
        finally:
            self.calls.discard(session)

    def drain(self) -> None:
        """The router drains: each call ends once its streams have (its send loop looks now)."""
        for session in self.calls:
            session.kick()
