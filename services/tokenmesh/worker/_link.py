"""The worker's side of ``Worker/Link``: every generation of one router on one call, one message per send.

One task reads the router's commands (starts, cancels, detaches, credit); the
handler's send loop writes. Nothing runs per generation but its pump (the
record's, as for Generate): a record calls the link when it has a new event,
the link puts the stream in its ``ready`` set and wakes the loop if it was
idle. The loop takes everything ready *now* into one ``LinkEvents`` and
writes it; while that write is in flight, what the engine produces piles up
in the records (an unread chunk merges the next, as for a slow Generate
reader), so one message carries what the engine produced since the previous
send. No timer, no batch to fill: a lone chunk leaves at once.

Backpressure is per generation: a chunk costs its UTF-8 bytes plus 16 of the
stream's credit, which the router returns as its caller reads. A stream
without credit is not taken; its record merges and, past the replay buffer,
the stream alone ends with READER_TOO_SLOW. Merging only in the record keeps
every seq a reader saw valid for Resume.

Linger (``--link-linger-us``, off at 0): with streams on their own phases a
send often holds one chunk (batches of one, a gRPC message each). With 2 or
more streams on the link and fewer of them ready than it carries, a send waits
up to the linger for the rest (it goes at once when every stream is ready):
never with one stream alone, never longer than the bound (at most 1 ms).

Pacing (the router's ``--stream-interval-ms``, the record's ``interval_s``):
a stream's chunk that is its record's unread tail waits until the interval
since the stream's previous chunk has passed, as a Generate reader waits
(``Record.held``); meanwhile the engine's output merges into it. A held
stream is left out of the ready set with one timer that marks it when due;
its end wakes it at once (the record's listener). Nothing of this runs per
token: merged appends call no one. A held stream is not waited for by the
linger (it will not be ready within it).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.trace import StatusCode

from tokenmesh.errors import Internal, InvalidArgument, MeshError, ResourceExhausted, label
from tokenmesh.v1 import inference_pb2, worker_pb2
from tokenmesh.wake import Wake
from tokenmesh.worker._registry import Record

log = logging.getLogger(__name__)

PROTOCOL = 1
"""The Link protocol this worker speaks (LinkSettings.protocol)."""

SETTINGS = worker_pb2.LinkSettings(
    protocol=PROTOCOL,
    # Near the per-generation call's HTTP/2 window (4 KiB on the router's worker channels): as much ahead of the
    # router's caller as before.
    default_window_bytes=4096,
    # A big message delays every stream behind it on the one HTTP/2 stream by its transfer time.
    max_batch_bytes=256 * 1024,
    max_streams=10_000,
)

CHUNK_OVERHEAD = 16
"""Credit a chunk costs beyond its text's bytes, so that empty chunks cost something too."""

UNLIMITED = 2**62
"""The credit of every stream once the router half-closed."""

Begin = Callable[[worker_pb2.WorkerCommand], tuple[Record, trace.Span]]
"""Admits, traces and starts a generation from a start command (or raises the MeshError Generate would end with)."""
Stop = Callable[[Record], None]
"""A cancel command: stops the generation and forgets it (it cannot be resumed), as on Generate."""
Release = Callable[[Record, bool], None]
"""The stream is over: (record, resumable) -> forget it, cancel it, or leave it for Attach."""


def trace_event(span: trace.Span, event: worker_pb2.WorkerEvent) -> None:
    """The engine's first token as an event; the end's finish reason and usage, or the failure, on the span."""
    kind = event.WhichOneof("event")
    if kind == "chunk":
        if event.chunk.HasField("engine_ttft_ms"):
            span.add_event("gen_ai.first_token", {"tokenmesh.engine_ttft_ms": event.chunk.engine_ttft_ms})
    elif kind == "end":
        reason = label(event.end.finish_reason, inference_pb2.FinishReason)
        span.set_attribute("gen_ai.response.finish_reasons", [reason])
        span.set_attribute("gen_ai.usage.input_tokens", event.end.usage.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", event.end.usage.completion_tokens)
    elif kind == "error":
        span.set_attribute("error.type", worker_pb2.ErrorClass.Name(event.error.error_class))
        span.set_status(StatusCode.ERROR, event.error.message)


@dataclass(eq=False)
class Linked:
    """One logical stream of a link: a generation, how far the link read it, and its credit."""

    stream: int
    record: Record
    span: trace.Span
    resumable: bool
    window: int
    """The credit it started with. A chunk larger than the credit left may go while that is at least 3/4 of the
    window: the router keeps back less than a quarter of it unreturned, so once it has read everything sent, the
    credit is there, and a merged chunk larger than the credit cannot wait for ever."""
    credit: int
    position: int = 0
    """Events of the record the link took (0-based, as Record.stream's position)."""
    tracing: bool = False
    listener: Callable[[], None] = field(default=lambda: None)
    due: float = 0.0
    """Paced: the loop time before which its unread tail chunk is not taken (0: the first chunk is not held)."""
    timer: asyncio.TimerHandle | None = None
    """Paced and held: marks it ready when due."""

    def starved(self) -> bool:
        """No credit left, and the record has not run past its buffer or finished: nothing to take now."""
        return self.credit <= 0 and not self.record.done and self.position >= self.record.evicted


@dataclass
class Batch:
    """One LinkEvents being filled, column by column (a few extend() calls per message, not a message per frame)."""

    budget: int
    streams: list[int] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    ends: list[worker_pb2.LinkEnd] = field(default_factory=list)
    ttft: dict[int, float] = field(default_factory=dict)

    def message(self) -> worker_pb2.LinkEvents | None:
        """The message, or None when nothing was taken."""
        if not self.streams and not self.ends:
            return None
        events = worker_pb2.LinkEvents(ends=self.ends, engine_ttft_ms=self.ttft)
        events.chunk_stream.extend(self.streams)
        events.chunk_seq.extend(self.seqs)
        events.chunk_text.extend(self.texts)
        events.chunk_tokens.extend(self.tokens)
        return events


class WorkerLink:
    """One ``Worker/Link`` call: its streams by id, the ready set, and the send loop.

    Args:
        begin: starts a generation as Generate does (admission, span, record).
        stop: what a cancel command does on Generate.
        release: what Generate does when its stream ends.
        linger_s: how long a send may wait for more of its streams to have a chunk (see the module).

    """

    streams: dict[int, Linked]
    ready: dict[int, Linked]
    """Streams with something to take, in the order they became ready (a dict as an ordered set)."""
    ends: list[worker_pb2.LinkEnd]
    """Ends of streams that never started (refusals), for the next message."""
    last_stream: int
    """The highest stream id started: ids increase and are never reused on a call."""
    closing: bool
    """The router half-closed: the call ends once every stream has (starts are no longer possible)."""
    linger_s: float
    """How long a send may wait for more streams to be ready (0: never)."""
    held: int
    """Streams whose next chunk waits for their interval (each with a timer): a linger does not wait for them."""
    _wake: Wake
    """The send loop's wait; while it lingers, a stream that becomes ready wakes it only once every stream is."""

    def __init__(self, begin: Begin, stop: Stop, release: Release, *, linger_s: float = 0.0) -> None:
        self._begin = begin
        self._stop = stop
        self._release = release
        self.linger_s = linger_s
        self.streams = {}
        self.ready = {}
        self.ends = []
        self.last_stream = 0
        self.closing = False
        self.held = 0
        self._wake = Wake()

    async def run(self, commands: AsyncIterator[worker_pb2.LinkCommands]) -> AsyncIterator[worker_pb2.LinkEvents]:
        """The settings, then one message per send until the router half-closes and every stream ended.

        When the call ends otherwise (the router died or cancelled it), every
        stream is released as a dropped Generate stream is: resumable
        generations run on for Attach, the others are cancelled.
        """
        reader = asyncio.create_task(self._read(commands))
        reader.add_done_callback(lambda _: self._wake.kick())
        try:
            yield worker_pb2.LinkEvents(settings=SETTINGS)
            while True:
                if self.linger_s and self._partial():
                    await self._wake.linger(self.linger_s)
                message = self._take()
                if message is not None:
                    yield message  # the one await: meanwhile the engine's output merges in the records
                    continue
                if reader.done():
                    reader.result()  # a command that did not parse ends the call with its status
                    if not self.streams and not self.ends:
                        return
                await self._wake.idle()
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # raised above already, where it mattered
                await reader
            for linked in list(self.streams.values()):
                self._drop(linked)

    def _partial(self) -> bool:
        """A send now would hold fewer streams' chunks than the link carries (2 or more), and nothing urgent waits.

        Urgent: a refusal, a generation's first event (its TTFT) or the end of one that finished. Streams held by
        their stream interval are not waited for.
        """
        return (
            bool(self.ready)
            and 2 <= len(self.streams) > len(self.ready) + self.held
            and not self.ends
            and not any(linked.position == 0 or linked.record.done for linked in self.ready.values())
        )

    def _mark(self, linked: Linked) -> None:
        """The stream has something to take (its record's listener): ready, and the loop awake."""
        if linked.starved():
            return  # credit will mark it; the record merges meanwhile
        if linked.record.interval_s and self._hold(linked):
            return  # its timer will mark it (the send loop is not woken for a chunk it would not take)
        self.ready[linked.stream] = linked
        if (
            not self._wake.lingering
            or len(self.ready) + self.held >= len(self.streams)
            or linked.position == 0
            or linked.record.done
        ):
            self._wake.kick()  # everything is ready, or something a linger must not hold (a first event, an end)

    # -- commands -------------------------------------------------------------------------------------------------

    async def _read(self, commands: AsyncIterator[worker_pb2.LinkCommands]) -> None:
        async for message in commands:
            for command in message.commands:
                self._apply(command)
            for stream, credit in zip(message.credit_stream, message.credit_bytes, strict=False):
                linked = self.streams.get(stream)
                if linked is not None:  # unknown: a grant racing the stream's end
                    linked.credit += credit
                    self._mark(linked)
        self._close()

    def _close(self) -> None:
        """The router half-closed: it can return no more credit, so none limits the streams' rest any longer."""
        self.closing = True
        for linked in self.streams.values():
            linked.window = linked.credit = UNLIMITED
            self._mark(linked)

    def _apply(self, command: worker_pb2.LinkCommand) -> None:
        kind = command.WhichOneof("command")
        if kind == "start":
            self._start(command)
            return
        linked = self.streams.get(command.stream)
        if linked is None:
            return  # a cancel or detach racing the stream's end
        if kind == "cancel":
            self._stop(linked.record)  # it ends with finish_reason CANCELLED, sent as its end
        elif kind == "detach":
            self._drop(linked)  # nothing more is sent for it

    def _start(self, command: worker_pb2.LinkCommand) -> None:
        stream = command.stream
        try:
            if stream <= self.last_stream:
                live = self.streams.get(stream)
                if live is not None:
                    self._drop(live)
                raise InvalidArgument(
                    f"stream {stream} is not above {self.last_stream}: stream ids are > 0 and increase on a link",
                    field="commands.stream",
                )
            self.last_stream = stream
            if len(self.streams) >= SETTINGS.max_streams:
                raise ResourceExhausted(
                    f"this link carries {SETTINGS.max_streams} streams already", reason="LINK_STREAMS_EXHAUSTED"
                )
            # Each generation's pump task copies this context: its log lines and spans are about its own request.
            record, span = contextvars.copy_context().run(self._begin, command.start)
        except Exception as exc:  # one bad start ends its own stream, never the link's other streams
            error = exc if isinstance(exc, MeshError) else Internal(f"the worker could not start it: {exc!r}")
            if error is not exc:
                log.exception("start of stream %d on a link failed", stream)
            self.ends.append(worker_pb2.LinkEnd(stream=stream, status=error.status()))
            self._wake.kick()
            return
        window = command.window_bytes or SETTINGS.default_window_bytes
        linked = Linked(stream, record, span, command.start.resumable, window, window, tracing=span.is_recording())
        linked.listener = lambda: self._mark(linked)
        self.streams[stream] = linked
        record.subscribe(linked.listener)

    def _drop(self, linked: Linked) -> None:
        """The stream is over on this link (ended, detached, or the link is): release its generation as Generate."""
        if self.streams.pop(linked.stream, None) is None:
            return
        self.ready.pop(linked.stream, None)
        if linked.timer is not None:
            linked.timer.cancel()
            self.held -= 1
        linked.record.unsubscribe(linked.listener)
        linked.span.end()
        self._release(linked.record, linked.resumable)

    # -- the send loop's take ---------------------------------------------------------------------------------------

    def _take(self) -> worker_pb2.LinkEvents | None:
        """Everything ready now, within each stream's credit and the message's budget, as one message."""
        if not self.ready and not self.ends:
            return None
        batch = Batch(SETTINGS.max_batch_bytes)
        batch.ends, self.ends = self.ends, []
        ready, self.ready = self.ready, {}
        for linked in ready.values():
            if self._take_stream(linked, batch):
                self.ready[linked.stream] = linked  # the budget ran out: first in the next message
        return batch.message()

    def _take_stream(self, linked: Linked, batch: Batch) -> bool:
        """Move the stream's unread events into batch; True when the budget stopped it with more to take."""
        record = linked.record
        while linked.position < record.total:
            if linked.position < record.evicted:
                self._end(linked, batch, worker_pb2.LinkEnd(stream=linked.stream, status=record.too_slow().status()))
                return False
            event = record.events[linked.position - record.evicted]
            if event.HasField("chunk"):
                if record.interval_s and self._hold(linked):
                    return False  # its timer marks it again
                cost = len(event.chunk.text.encode()) + CHUNK_OVERHEAD
                if cost > linked.credit and linked.credit < linked.window - linked.window // 4:
                    return False  # starved: the grant marks it again
                if cost > batch.budget and (batch.streams or batch.ends):
                    return True
                self._add_chunk(linked, batch, event, cost)
            else:
                self._end(linked, batch, worker_pb2.LinkEnd(stream=linked.stream, event=event))
                return False
        return False

    def _hold(self, linked: Linked) -> bool:
        """Whether the stream's next event is a chunk that waits for its interval (Record.held); a timer marks it."""
        loop = asyncio.get_running_loop()
        record = linked.record
        if not record.held(linked.position, linked.due, loop.time()) or not record.events[-1].HasField("chunk"):
            return False  # held() says the next event is the last: an end appended just now goes at once
        if linked.timer is None:  # one per held stream, however often its record wakes the link meanwhile
            linked.timer = loop.call_at(linked.due, self._due, linked)
            self.held += 1
        return True

    def _due(self, linked: Linked) -> None:
        linked.timer = None
        self.held -= 1
        self._mark(linked)

    def _add_chunk(self, linked: Linked, batch: Batch, event: worker_pb2.WorkerEvent, cost: int) -> None:
        chunk = event.chunk
        batch.streams.append(linked.stream)
        batch.seqs.append(event.seq)
        batch.texts.append(chunk.text)
        batch.tokens.append(chunk.token_count)
        if chunk.HasField("engine_ttft_ms"):
            batch.ttft[linked.stream] = chunk.engine_ttft_ms
        batch.budget -= cost
        linked.credit -= cost
        if linked.record.interval_s:
            linked.due = asyncio.get_running_loop().time() + linked.record.interval_s
        self._advance(linked, event)

    def _end(self, linked: Linked, batch: Batch, end: worker_pb2.LinkEnd) -> None:
        batch.ends.append(end)
        if end.HasField("event"):
            self._advance(linked, end.event)
        self._drop(linked)

    @staticmethod
    def _advance(linked: Linked, event: worker_pb2.WorkerEvent) -> None:
        """The link took the event: no later chunk merges into it (its seq is what the router saw)."""
        linked.position += 1
        record = linked.record
        record.read = max(record.read, linked.position)
        if linked.tracing:
            trace_event(linked.span, event)
