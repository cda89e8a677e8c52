"""One attempt of a generation on one worker: start it, relay its chunks, tell a worker failure from a caller error.

The per-chunk loop in :meth:`Relay.run` is the router's hot path: one read
and one yield per worker event, no extra await, call layer or allocation.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

import grpc

from tokenmesh.errors import Aborted
from tokenmesh.router._cancels import WorkerCancels
from tokenmesh.router._config import RouterConfig
from tokenmesh.router._generation import Caller, Progress
from tokenmesh.router._live import Live
from tokenmesh.router._outcome import WorkerFailed, outcome
from tokenmesh.router._pool import WorkerEntry
from tokenmesh.router._transport import WorkerStream, WorkerTransports, stop
from tokenmesh.v1 import inference_pb2, worker_pb2

STRUCTURED_NOT_CONTINUED = "STRUCTURED_NOT_CONTINUED"
"""The reason of the Aborted a structured generation ends with when its worker failed mid-output."""


def continuation(base: inference_pb2.GenerateRequest, progress: Progress) -> inference_pb2.GenerateRequest | None:
    """The request that continues base after what progress delivered (None: nothing left to generate).

    A raw prompt is extended by the delivered text; a chat gets it as (the end
    of) a trailing assistant message, which the model continues. The seed and
    every other setting stay; max_tokens shrinks by what was delivered.

    A generation with a structured_output is not continued once text was delivered: the engine would start its
    format again after that text (a second JSON object after half of one), so it ends with Aborted instead.
    """
    if progress.seq == 0:
        return base
    remaining = base.max_tokens - progress.tokens
    if remaining <= 0:
        return None
    if base.HasField("structured_output"):
        raise Aborted(
            f"the worker running generation {base.request_id!r} failed after {progress.seq} chunks, and a "
            "generation with a structured_output is not continued on another worker (its format would start "
            "again mid-output): send the request again",
            reason=STRUCTURED_NOT_CONTINUED,
            metadata={"delivered_chunks": str(progress.seq)},
        )
    forward = inference_pb2.GenerateRequest()
    forward.CopyFrom(base)
    forward.max_tokens = remaining
    delivered = "".join(progress.text)
    if base.messages:
        if base.messages[-1].role == "assistant":
            forward.messages[-1].content += delivered
        else:
            forward.messages.add(role="assistant", content=delivered)
    else:
        forward.prompt = base.prompt + delivered
    return forward


def chunk(event: worker_pb2.WorkerEvent, request_id: str, model: str) -> inference_pb2.GenerateChunk:
    """The caller's chunk for a worker's chunk or end event (seq from the worker)."""
    if event.WhichOneof("event") == "chunk":
        piece = inference_pb2.GenerateChunk(
            request_id=request_id,
            seq=event.seq,
            text=event.chunk.text,
            token_count=event.chunk.token_count,
            model=model,
        )
        if event.chunk.logprobs:  # only then: an empty repeated field costs a copy per chunk on the hot path
            piece.logprobs.extend(event.chunk.logprobs)
        return piece
    end = event.end
    return inference_pb2.GenerateChunk(
        request_id=request_id,
        seq=event.seq,
        token_count=end.token_count,
        finish_reason=end.finish_reason,
        usage=end.usage,
        model=model,
    )


LOOP_LAG_S = 0.5
"""A watchdog timer that runs this late shows the router's own loop was busy: reads may be waiting, so it looks
again before it judges (the mesh's own lag is never read as a worker's stall)."""


class StallWatchdog:
    """Cancels a worker call that sends nothing for too long (then ``stalled`` says why).

    One timer per stream that re-arms itself, instead of a timeout around
    every read: a read per token is the router's hot path. Only time spent
    waiting for a read counts: while the router waits for a slow caller, the
    worker is not stalled. Between events a stall is the *worker's* silence:
    while other attempts on the same worker keep reading events (its engine
    is busy, e.g. a saturated machine), a silent generation is failed over
    only after ``slow_s`` of its own silence, since moving work off a busy
    worker onto its busy peers turns overload into a cascade of re-prefills.

    Args:
        call: the worker call to cancel on a stall.
        entry: the worker (its ``heard_at``, updated here on every event).
        first_s: longest wait for the first event.
        between_s: longest silence of the worker between later events.
        slow_s: longest silence of this generation while its worker is heard from.

    """

    stalled: str
    """Why the call was cancelled ('' while it was not)."""
    kind: str
    """The failure's kind once stalled: ``stall`` (the worker silent) or ``slow`` (only this generation silent)."""
    _call: WorkerStream
    _entry: WorkerEntry
    _loop: asyncio.AbstractEventLoop
    _limit: float
    _between: float
    _slow: float
    _since: float
    _reading: bool
    _started: bool
    """An event came: the limit is the stall limit, no longer the TTFT one."""
    _due: float
    _timer: asyncio.TimerHandle

    def __init__(self, call: WorkerStream, entry: WorkerEntry, first_s: float, between_s: float, slow_s: float) -> None:
        self._call = call
        self._entry = entry
        self._loop = asyncio.get_running_loop()
        self._limit = first_s
        self._between = between_s
        self._slow = max(slow_s, between_s)
        self._since = self._loop.time()
        self._reading = True
        self._started = False
        self.stalled = ""
        self.kind = "stall"
        self._arm(self._since + first_s)

    def _arm(self, due: float) -> None:
        self._due = due
        self._timer = self._loop.call_at(due, self._check)

    def reading(self) -> None:
        """A read begins: silence counts from now."""
        self._since = self._loop.time()
        self._reading = True

    def fed(self) -> None:
        """The read returned an event."""
        self._reading = False
        self._entry.heard_at = now = self._loop.time()
        if not self._started:  # the first event: from the TTFT limit to the stall limit
            self._started = True
            self._limit = self._between
            self._timer.cancel()
            self._arm(now + self._between)

    def _check(self) -> None:
        now = self._loop.time()
        if now - self._due > LOOP_LAG_S:  # the router's loop ran late: let waiting reads in, then look again
            self._arm(now + LOOP_LAG_S / 10)
            return
        if not self._reading:  # the router is busy with the caller: look again later
            self._arm(now + self._limit)
            return
        due = self._since + self._limit
        if now < due:
            self._arm(due)
            return
        if self._started and now - self._entry.heard_at < self._between:
            quiet = self._since + self._slow  # the worker is sending others' events: busy, not stalled
            if now < quiet:
                self._arm(min(quiet, self._entry.heard_at + self._between))
                return
            self.stalled = f"stalled: no output for {self._slow:g} s while the worker sent other generations' tokens"
            self.kind = "slow"
        else:
            self.stalled = f"stalled: no output for {self._limit:g} s"
        self._call.cancel()

    def stop(self) -> None:
        """No more checks."""
        self._timer.cancel()


def _count(event: worker_pb2.WorkerEvent, kind: str | None, progress: Progress, address: str) -> None:
    """Take the worker's next event into progress; raise what ends the attempt.

    A reported error ends it as :func:`outcome` says (fail over, or the
    caller's error); a seq out of order is the worker's failure.
    """
    if kind == "error":
        raise outcome(event.error, address, received=True)
    if event.seq != progress.seq + 1:
        raise WorkerFailed(f"worker sent seq {event.seq}, expected {progress.seq + 1}", "seq_gap")
    if event.seq == 1:
        _first_event(progress, event)
    progress.seq = event.seq


class Relay:
    """Runs one attempt of a generation on one worker and relays its chunks.

    Args:
        config: the router's settings (the TTFT and stall limits).
        transports: the road to each worker.
        cancels: stops, on its worker, what an attempt leaves behind.

    """

    _ttft_timeout_s: float
    _stall_timeout_s: float
    _transports: WorkerTransports
    _cancels: WorkerCancels

    def __init__(self, config: RouterConfig, transports: WorkerTransports, cancels: WorkerCancels) -> None:
        self._ttft_timeout_s = config.ttft_timeout_s
        self._stall_timeout_s = config.stall_timeout_s
        self._transports = transports
        self._cancels = cancels

    async def run(
        self,
        entry: WorkerEntry,
        start: worker_pb2.WorkerCommand,
        live: Live,
        progress: Progress,
        trace_context: dict[str, str] | None = None,
    ) -> AsyncGenerator[inference_pb2.GenerateChunk, None]:
        """Run start (see :func:`start_command`) on entry's worker, its chunks numbered after progress.seq.

        Raises WorkerFailed when the worker is at fault (it died, stalled, or
        reported a backend failure), so the caller's stream can continue
        elsewhere. When the caller goes away from a resumable generation (one
        with a caller-chosen request_id) the worker keeps it for Resume;
        otherwise the worker is told to stop. With trace_context (a traced generation) the attempt carries that
        context (:mod:`tokenmesh.router._transport`).
        """
        forward = start.start
        call = self._transports.open(entry.address, start, trace_context)
        live.call = call
        watchdog = StallWatchdog(call, entry, self._ttft_timeout_s, self._stall_timeout_s, self._ttft_timeout_s)
        received = finished = detach = False
        try:
            await _start(call, start, live)
            while True:
                watchdog.reading()
                event: Any = await call.read()  # a WorkerEvent, or EOF from a Generate call
                if event is grpc.aio.EOF:
                    raise outcome(None, entry.address, received=received)
                watchdog.fed()
                received = True
                kind = event.WhichOneof("event")
                finished = kind != "chunk"  # an end or an error: the worker is done with it, nothing to cancel
                _count(event, kind, progress, entry.address)
                if kind == "chunk":
                    progress.text.append(event.chunk.text)
                    progress.tokens += event.chunk.token_count
                    yield chunk(event, forward.request_id, forward.model)
                    continue
                entry.served_total += 1
                yield _last(event, forward, progress)
                return
        except grpc.aio.AioRpcError as exc:
            raise outcome(exc, entry.address, received=received) from exc
        except asyncio.CancelledError:
            if watchdog.stalled:
                raise WorkerFailed(watchdog.stalled, watchdog.kind) from None
            detach = start.resumable  # the caller went away
            raise
        except GeneratorExit:
            detach = start.resumable  # the caller went away
            raise
        finally:
            watchdog.stop()
            live.call = None
            call.cancel()
            # Stop what the worker would run for no one, where letting go does not (see WorkerStream).
            if not finished and not detach and (start.resumable or not call.stops_on_close):
                self._cancels.abandon(entry.address, forward.request_id)


async def _start(call: WorkerStream, start: worker_pb2.WorkerCommand, live: Live) -> None:
    """Send the start; a spare the worker ended meanwhile raises its status (failed over)."""
    await call.write(start)
    if live.cancelled.done():  # Cancel came while the start was on its way
        await stop(call)


def start_command(
    forward: inference_pb2.GenerateRequest,
    progress: Progress,
    context: Caller,
    *,
    resumable: bool,
    trace_context: dict[str, str] | None = None,
    stream_interval_ms: int = 0,
) -> worker_pb2.WorkerCommand:
    """The worker's start command for an attempt: forward, numbered after progress, within the caller's deadline.

    Args:
        forward: the request to run (see :func:`continuation`).
        progress: what reached the caller before.
        context: the caller's call (its deadline).
        resumable: the worker keeps the generation for Resume when the caller goes away (a caller-chosen id).
        trace_context: the W3C headers that make the router's span the parent of the worker's, when the router does
            not trace (the caller's context; tracing, they go in the worker call's metadata instead).
        stream_interval_ms: the router's ``--stream-interval-ms``: the worker paces the generation's readers.

    """
    start = worker_pb2.WorkerCommand(
        start=forward,
        first_seq=progress.seq + 1,
        tokens_before=progress.tokens,
        resumable=resumable,
        stream_interval_ms=stream_interval_ms,
    )
    remaining = context.time_remaining()
    if remaining is not None:
        start.timeout_s = remaining
    if trace_context:
        start.trace_context.update(trace_context)
    return start


def _first_event(progress: Progress, event: worker_pb2.WorkerEvent) -> None:
    """Where the time to the first token went: the engine's share (when it says) and the router's."""
    if event.chunk.HasField("engine_ttft_ms"):
        progress.timing.engine_ttft_ms = event.chunk.engine_ttft_ms
    progress.timing.router_ttft_ms = (time.monotonic() - progress.started) * 1000


def _last(
    event: worker_pb2.WorkerEvent, forward: inference_pb2.GenerateRequest, progress: Progress
) -> inference_pb2.GenerateChunk:
    """The caller's final chunk for the worker's end event: with the migrations and timing of the whole stream."""
    final = chunk(event, forward.request_id, forward.model)
    final.migrations = progress.migrations
    final.timing.CopyFrom(progress.timing)
    return final
