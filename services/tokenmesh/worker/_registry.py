"""The worker's generations by request_id, each with a bounded replay buffer.

A generation runs in its own task, not in the RPC that started it: when the
router's stream drops (the router died, or its caller went away) the
generation goes on into its replay buffer for the resume grace period, so a
caller can re-attach through any router (``Attach``). An explicit cancel stops
it and forgets it. Records are dropped once finished (or detached) for longer
than the grace period; a detached generation still running then is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from tokenmesh.errors import NotFound, OutOfRange, ResourceExhausted
from tokenmesh.v1 import inference_pb2, worker_pb2
from tokenmesh.worker._backend import BackendError, Delta, Generation

log = logging.getLogger(__name__)

FINISH_REASONS = {
    "stop": inference_pb2.FINISH_REASON_STOP,
    "length": inference_pb2.FINISH_REASON_LENGTH,
    "cancelled": inference_pb2.FINISH_REASON_CANCELLED,
}


MERGED_SHARE = 8
"""A merged chunk stays under 1/8 of the replay buffer, so a reader that stops reading still overflows it."""


def _release(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Record:
    """One generation: its events so far (bounded in bytes) and its state.

    Events are numbered by position: the event at position i (0-based) has
    seq first_seq + i; only a final error carries no seq. The buffer drops
    the oldest events beyond max_bytes, counting them in ``evicted``.

    With ``interval_s`` (the router's ``--stream-interval-ms``) every reader
    is paced, as vLLM's ``--stream-interval``: after taking a chunk it takes
    the next no sooner than interval_s later, while that chunk is the unread
    tail (so it grows by merging, see :meth:`append`) and the generation runs
    on. The first chunk, the end, and a backlog (a replay, chunks the merge
    could not grow) are never held: pacing only gives merging time, and
    merging happens here alone, so every seq a reader saw keeps its meaning.
    """

    def __init__(
        self,
        request_id: str,
        first_seq: int,
        tokens_before: int,
        generation: Generation,
        max_bytes: int,
        *,
        interval_s: float = 0.0,
    ) -> None:
        self.request_id = request_id
        self.first_seq = first_seq
        self.tokens_before = tokens_before
        """Tokens delivered by earlier workers (this one continues their text)."""
        self.tokens = 0
        """Tokens in this record's chunks."""
        self.generation = generation
        self.events: deque[worker_pb2.WorkerEvent] = deque()
        self.evicted = 0
        self.bytes = 0
        self.max_bytes = max_bytes
        self.interval_s = interval_s
        """A reader takes a chunk that may still grow at most once per this many seconds (0: at once)."""
        self.read = 0
        """Events some reader has taken (those are never merged into)."""
        self.done = False
        self.finished_at = 0.0
        self.attached = 0
        self.detached_at = time.monotonic()
        self._waiters: set[asyncio.Future[None]] = set()
        """One future per reader waiting for the next event (cheaper per token than a Condition's lock)."""
        self._listeners: list[Callable[[], None]] = []
        """Called on every new event and on finish (a Link's streams: no task or future per generation)."""
        self.task: asyncio.Task[None] | None = None
        self.queued = False
        """It started with every engine slot busy (so its TTFT includes queueing); set by the worker."""
        self.shed_reason = ""
        """Set when the worker sheds this generation: it ends in a retryable error, not CANCELLED."""

    @property
    def total(self) -> int:
        """Events produced so far (kept or evicted)."""
        return self.evicted + len(self.events)

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call listener on every new event and on finish; until unsubscribed, it counts as an attached reader.

        An append merged into an unread chunk calls nobody: the subscriber was
        told of that chunk and has not taken it yet.
        """
        self._listeners.append(listener)
        self.attached += 1

    def unsubscribe(self, listener: Callable[[], None]) -> None:
        """Stop calling listener; the record is detached (its resume grace starts) when no reader is left."""
        self._listeners.remove(listener)
        self.attached -= 1
        if not self.attached:
            self.detached_at = time.monotonic()

    def too_slow(self) -> ResourceExhausted:
        """The error of a reader the generation ran further ahead of than the replay buffer holds."""
        return ResourceExhausted(
            f"reader too slow: generation {self.request_id} ran more than {self.max_bytes} "
            "bytes ahead of it; read faster, or Resume from the last seq received",
            reason="READER_TOO_SLOW",
            metadata={"request_id": self.request_id},
        )

    def _wake(self) -> None:
        for listener in self._listeners:
            listener()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    async def _changed(self, due: float | None = None) -> None:
        """Wait for the next append (one not merged) or finish; with due, at most until then (the loop's clock)."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiters.add(waiter)
        timer = None if due is None else loop.call_at(due, _release, waiter)
        try:
            await waiter
        finally:
            if timer is not None:
                timer.cancel()
            self._waiters.discard(waiter)

    def held(self, position: int, due: float, now: float) -> bool:
        """Whether a paced reader at position waits until due (its loop time) before taking the chunk there.

        Only the unread tail of a generation still running waits: it may grow by merging until then. Events
        behind it are fixed already (waiting would only delay them), and a finished generation's end goes at once.
        """
        return now < due and position == self.total - 1 and not self.done

    def append(self, event: worker_pb2.WorkerEvent) -> None:
        """Add an event, evicting the oldest beyond the byte budget; wake readers.

        A chunk that arrives while the previous chunk is still unread by every
        reader is merged into it (text, token count and logprobs): a reader that falls
        behind gets fewer, larger messages (a paced reader too, by design:
        see the class), never a chunk held back for it. Only
        unread chunks are merged, so every seq a reader saw keeps its meaning
        for Resume.
        """
        last = self.events[-1] if self.events and self.total > self.read else None
        if (
            last is not None
            and event.HasField("chunk")
            and last.HasField("chunk")
            and last.ByteSize() + event.ByteSize() <= self.max_bytes // MERGED_SHARE
        ):
            self.bytes -= last.ByteSize()
            last.chunk.text += event.chunk.text
            last.chunk.token_count += event.chunk.token_count
            last.chunk.logprobs.extend(event.chunk.logprobs)  # still one per token, in order
            self.bytes += last.ByteSize()
            return  # readers were woken for that chunk and have not taken it yet
        if event.WhichOneof("event") != "error":
            event.seq = self.first_seq + self.total
        size = event.ByteSize()
        self.events.append(event)
        self.bytes += size
        while self.bytes > self.max_bytes and len(self.events) > 1:
            self.bytes -= self.events.popleft().ByteSize()
            self.evicted += 1
        self._wake()

    def finish(self) -> None:
        """Mark done (no more events) and wake readers."""
        self.done = True
        self.finished_at = time.monotonic()
        self._wake()

    def _check_from(self, after_seq: int) -> int:
        """The position a reader after after_seq starts at, or the OutOfRange that says why it cannot."""
        position = after_seq - self.first_seq + 1
        if position < 0:
            raise OutOfRange(
                f"this worker holds generation {self.request_id} from seq {self.first_seq} on; "
                f"seq {after_seq + 1} to {self.first_seq - 1} came from a worker that is gone",
                reason="SEQ_NOT_HELD",
                metadata={"request_id": self.request_id, "first_seq": str(self.first_seq)},
            )
        if position > self.total:
            raise OutOfRange(
                f"after_seq {after_seq} is beyond the last seq sent, {self.first_seq + self.total - 1}",
                reason="AFTER_SEQ_BEYOND_LAST",
                metadata={"request_id": self.request_id},
            )
        if position == self.total and self.done and self.events and self.events[-1].WhichOneof("event") == "end":
            # The caller has every chunk, the final one too (e.g. an EventSource reconnecting after [DONE]).
            raise OutOfRange(
                f"generation {self.request_id} ended at seq {after_seq}: nothing comes after it",
                reason="GENERATION_ENDED",
                metadata={"request_id": self.request_id},
            )
        if position < self.evicted:
            raise OutOfRange(
                f"events before seq {self.first_seq + self.evicted} are no longer kept (replay buffer is "
                f"{self.max_bytes} bytes); resume from after_seq >= {self.first_seq + self.evicted - 1}",
                reason="REPLAY_EVICTED",
                metadata={"request_id": self.request_id},
            )
        return position

    async def stream(self, after_seq: int) -> AsyncIterator[worker_pb2.WorkerEvent]:
        """Events with seq > after_seq (and a final error), then live ones until done (paced: see the class)."""
        position = self._check_from(after_seq)
        loop = asyncio.get_running_loop()
        due = 0.0  # the first chunk is never held
        self.attached += 1
        try:
            while True:
                while position < self.total:
                    if position < self.evicted:
                        raise self.too_slow()
                    event = self.events[position - self.evicted]
                    if self.interval_s and event.HasField("chunk"):
                        if self.held(position, due, loop.time()):
                            await self._changed(due)  # meanwhile the engine's output merges into this chunk
                            continue
                        due = loop.time() + self.interval_s
                    position += 1
                    self.read = max(self.read, position)
                    yield event
                    if not event.seq:
                        return  # an error ends the stream
                if self.done:
                    return
                await self._changed()
        finally:
            self.attached -= 1
            if not self.attached:
                self.detached_at = time.monotonic()


class Registry:
    """Records by request_id, their pump tasks, and garbage collection."""

    def __init__(
        self,
        grace_s: float,
        max_bytes: int,
        on_settled: Callable[[Record], None],
        on_error: Callable[[Record, BackendError], None] = lambda record, error: None,
        on_token_timing: Callable[[Record, float | None, float | None], None] = lambda record, ttft, gap: None,
    ) -> None:
        self.grace_s = grace_s
        self.max_bytes = max_bytes
        self.records: dict[str, Record] = {}
        self._on_settled = on_settled
        self._on_error = on_error
        self._on_token_timing = on_token_timing
        self._gc: asyncio.Task[None] | None = None

    def start(
        self, request_id: str, first_seq: int, tokens_before: int, generation: Generation, *, interval_s: float = 0.0
    ) -> Record:
        """Register and start pumping a generation (replacing a stale one by the same id); see Record's interval_s."""
        old = self.records.pop(request_id, None)
        if old is not None:
            self._stop(old)
        record = Record(request_id, first_seq, tokens_before, generation, self.max_bytes, interval_s=interval_s)
        self.records[request_id] = record
        record.task = asyncio.create_task(self._pump(record))
        if self._gc is None:
            self._gc = asyncio.create_task(self._collect())
        return record

    def get(self, request_id: str) -> Record:
        """The record by id, or NotFound."""
        record = self.records.get(request_id)
        if record is None:
            raise NotFound(
                f"no generation {request_id!r} here (never started, cancelled, or its "
                f"{self.grace_s:g} s resume grace period is over)",
                reason="GENERATION_NOT_FOUND",
                metadata={"request_id": request_id},
            )
        return record

    def cancel(self, request_id: str) -> bool:
        """Stop and forget a generation; False when unknown."""
        record = self.records.pop(request_id, None)
        if record is None:
            return False
        self._stop(record)
        return True

    def shed(self, record: Record, reason: str) -> None:
        """Stop a generation so that it ends in a retryable error (the router runs it elsewhere)."""
        record.shed_reason = reason
        self.records.pop(record.request_id, None)
        record.generation.cancel()

    def forget(self, record: Record) -> None:
        """Drop a finished record nobody will resume (it is not cancelled: it is done)."""
        if self.records.get(record.request_id) is record:
            del self.records[record.request_id]

    @staticmethod
    def _stop(record: Record) -> None:
        record.generation.cancel()

    async def _pump(self, record: Record) -> None:
        last = time.monotonic()
        try:
            async for event in record.generation:
                if isinstance(event, Delta):
                    now = time.monotonic()
                    chunk = worker_pb2.TokenChunk(text=event.text, token_count=event.tokens, logprobs=event.logprobs)
                    if record.total == 0:
                        self._on_token_timing(record, now - last, None)
                        chunk.engine_ttft_ms = (now - last) * 1000
                    else:
                        self._on_token_timing(record, None, (now - last) / max(event.tokens, 1))
                    last = now
                    record.tokens += event.tokens
                    record.append(worker_pb2.WorkerEvent(chunk=chunk))
                    continue
                if event.reason == "cancelled" and record.shed_reason:
                    raise BackendError(worker_pb2.ERROR_CLASS_UNAVAILABLE, record.shed_reason)
                before = record.tokens_before
                # A continuation's prompt holds the text earlier workers delivered.
                prompt_tokens = max(0, event.prompt_tokens - before)
                usage = inference_pb2.Usage(
                    prompt_tokens=prompt_tokens,
                    completion_tokens=before + event.completion_tokens,
                    # What the engine reused is a prefix of the prompt it got: of it, the caller's own prompt's part.
                    cached_prompt_tokens=min(event.cached_prompt_tokens, prompt_tokens),
                )
                reason = FINISH_REASONS.get(event.reason, inference_pb2.FINISH_REASON_STOP)
                extra = max(0, event.completion_tokens - record.tokens)
                end = worker_pb2.GenerationEnd(finish_reason=reason, usage=usage, token_count=extra)
                record.append(worker_pb2.WorkerEvent(end=end))
                break
        except BackendError as error:
            log.warning("generation %s failed (%s): %s", record.request_id, error.error_class, error.message)
            err = worker_pb2.GenerationError(error_class=error.error_class, message=error.message)
            record.append(worker_pb2.WorkerEvent(error=err))
            self._on_error(record, error)
        except asyncio.CancelledError:
            record.generation.cancel()
            raise
        finally:
            record.finish()
            self._on_settled(record)

    async def _collect(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.grace_s / 4))
            now = time.monotonic()
            for request_id, record in list(self.records.items()):
                if record.attached:
                    continue
                idle_since = max(record.finished_at, record.detached_at) if record.done else record.detached_at
                if now - idle_since > self.grace_s:
                    log.info("dropping generation %s: nobody attached for %g s", request_id, self.grace_s)
                    self.records.pop(request_id, None)
                    self._stop(record)

    async def close(self) -> None:
        """Cancel every generation and the collector."""
        for record in list(self.records.values()):
            self._stop(record)
        tasks = [r.task for r in self.records.values() if r.task is not None]
        if self._gc is not None:
            tasks.append(self._gc)
            self._gc.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, 5)
        self.records.clear()
