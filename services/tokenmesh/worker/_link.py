"""The worker's side of ``Worker/Link``: every generation of one router on one call, one message per send.

The server end of :mod:`tokenmesh.mux`. Nothing runs per generation but its
pump (the record's, as for Generate): a record calls the link when it has a
new event, and the link marks the stream ready. What the engine produces
while a message is being written piles up in the records (an unread chunk
merges the next, as for a slow Generate reader), so one message carries what
the engine produced since the previous send.

Backpressure is per generation: a stream without credit is not taken; its
record merges and, past the replay buffer, the stream alone ends with
READER_TOO_SLOW. Merging only in the record keeps every seq a reader saw
valid for Resume. Linger: ``--link-linger-us`` (at most 1 ms, off at 0).

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
import contextvars
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.trace import StatusCode

from tokenmesh.errors import label
from tokenmesh.mux import (
    DEFAULT_MAX_BATCH_BYTES,
    DEFAULT_WINDOW_BYTES,
    MAX_STREAMS,
    PROTOCOL,
    Batch,
    Served,
    ServerSession,
    cost,
    fits,
)
from tokenmesh.v1 import inference_pb2, worker_pb2
from tokenmesh.worker._registry import Record

SETTINGS = worker_pb2.LinkSettings(
    protocol=PROTOCOL,
    # The per-generation call's HTTP/2 window (4 KiB on the router's worker channels): as much ahead of the router's
    # caller as before.
    default_window_bytes=DEFAULT_WINDOW_BYTES,
    max_batch_bytes=DEFAULT_MAX_BATCH_BYTES,
    max_streams=MAX_STREAMS,
)

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
class Linked(Served):
    """One logical stream of a link: a generation, and how far the link read it."""

    record: Record = field(kw_only=True)
    span: trace.Span = field(kw_only=True)
    resumable: bool = field(kw_only=True)
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
class Columns(Batch):
    """One LinkEvents being filled, column by column."""

    seqs: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    ttft: dict[int, float] = field(default_factory=dict)
    logprobs: dict[int, worker_pb2.ChunkLogprobs] = field(default_factory=dict)
    """By chunk index: only chunks that carry logprobs."""


class WorkerLink(ServerSession[Linked]):
    """One ``Worker/Link`` call: a stream per generation, each read from its record.

    Args:
        begin: starts a generation as Generate does (admission, span, record).
        stop: what a cancel command does on Generate.
        release: what Generate does when its stream ends (a dropped call: resumable ones run on for Attach).
        linger_s: how long a send may wait for more of its streams to have a chunk.

    """

    def __init__(self, begin: Begin, stop: Stop, release: Release, *, linger_s: float = 0.0) -> None:
        super().__init__(SETTINGS, worker_pb2.LinkEvents, worker_pb2.LinkEnd, linger_s=linger_s)
        self._begin = begin
        self._stop = stop
        self._release = release

    def urgent(self, served: Linked) -> bool:
        """A generation's first event (its TTFT) or the end of one that finished."""
        return served.position == 0 or served.record.done

    def mark(self, served: Linked) -> None:
        """The stream's record has something to take (its listener), unless credit or its interval holds it."""
        if served.starved():
            return  # credit will mark it; the record merges meanwhile
        if served.record.interval_s and self._hold(served):
            return  # its timer will mark it (the send loop is not woken for a chunk it would not take)
        super().mark(served)

    granted = mark

    def cancel(self, served: Linked) -> None:
        """Stop the generation: it ends with finish_reason CANCELLED, sent as its end."""
        self._stop(served.record)

    def start(self, command: worker_pb2.LinkCommand) -> Linked:
        """Admit and start the generation (Generate's checks); its record wakes the link."""
        # Each generation's pump task copies this context: its log lines and spans are about its own request.
        record, span = contextvars.copy_context().run(self._begin, command.start)
        window = command.window_bytes or SETTINGS.default_window_bytes
        linked = Linked(
            command.stream,
            window,
            window,
            record=record,
            span=span,
            resumable=command.start.resumable,
            tracing=span.is_recording(),
        )
        linked.listener = lambda: self.mark(linked)
        record.subscribe(linked.listener)
        return linked

    def released(self, served: Linked) -> None:
        """Release the generation as Generate does when its stream ends."""
        if served.timer is not None:
            served.timer.cancel()
            self.held -= 1
        served.record.unsubscribe(served.listener)
        served.span.end()
        self._release(served.record, served.resumable)

    # -- the send loop's take ---------------------------------------------------------------------------------------

    def batch(self, budget: int, ends: list[worker_pb2.LinkEnd]) -> Columns:
        """An empty LinkEvents being filled."""
        return Columns(budget, ends)

    def message(self, batch: Columns) -> worker_pb2.LinkEvents | None:
        """The message, or None when nothing was taken."""
        if not batch.streams and not batch.ends:
            return None
        events = worker_pb2.LinkEvents(ends=batch.ends, engine_ttft_ms=batch.ttft, chunk_logprobs=batch.logprobs)
        events.chunk_stream.extend(batch.streams)
        events.chunk_seq.extend(batch.seqs)
        events.chunk_text.extend(batch.texts)
        events.chunk_tokens.extend(batch.tokens)
        return events

    def take_stream(self, served: Linked, batch: Columns) -> bool:
        """Move the stream's unread events into batch; True when the budget stopped it with more to take."""
        record = served.record
        while served.position < record.total:
            if served.position < record.evicted:
                self._end(served, batch, self.end_of(served.stream, record.too_slow()))
                return False
            event = record.events[served.position - record.evicted]
            if event.HasField("chunk"):
                if record.interval_s and self._hold(served):
                    return False  # its timer marks it again
                size = cost(event.chunk.text)
                if not fits(size, served.credit, served.window):
                    return False  # starved: the grant marks it again
                if batch.full(size):
                    return True
                self._add_chunk(served, batch, event, size)
            else:
                self._end(served, batch, worker_pb2.LinkEnd(stream=served.stream, event=event))
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
        self.mark(linked)

    def _add_chunk(self, linked: Linked, batch: Columns, event: worker_pb2.WorkerEvent, size: int) -> None:
        chunk = event.chunk
        batch.streams.append(linked.stream)
        batch.seqs.append(event.seq)
        batch.texts.append(chunk.text)
        batch.tokens.append(chunk.token_count)
        if chunk.HasField("engine_ttft_ms"):
            batch.ttft[linked.stream] = chunk.engine_ttft_ms
        if chunk.logprobs:
            batch.logprobs[len(batch.streams) - 1] = worker_pb2.ChunkLogprobs(tokens=chunk.logprobs)
        batch.budget -= size
        linked.credit -= size
        if linked.record.interval_s:
            linked.due = asyncio.get_running_loop().time() + linked.record.interval_s
        self._advance(linked, event)

    def _end(self, linked: Linked, batch: Columns, end: worker_pb2.LinkEnd) -> None:
        batch.ends.append(end)
        if end.HasField("event"):
            self._advance(linked, end.event)
        self.drop(linked)

    @staticmethod
    def _advance(linked: Linked, event: worker_pb2.WorkerEvent) -> None:
        """The link took the event: no later chunk merges into it (its seq is what the router saw)."""
        linked.position += 1
        record = linked.record
        record.read = max(record.read, linked.position)
        if linked.tracing:
            trace_event(linked.span, event)
