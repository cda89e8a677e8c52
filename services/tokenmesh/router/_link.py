"""The router's side of ``Worker/Link``: one call per worker carrying every generation this router runs there.

A :class:`LinkSession` is one open call: one reader task (the per-peer task
on the worker's :class:`~tokenmesh.links.Link`) and one writer task, nothing
per generation. Each attempt of a generation is an :class:`Attempt`, which
:meth:`~tokenmesh.router._relay.Relay.run` reads as it reads a
``Worker/Generate`` call (``read``/``write``/``cancel``): the same seq checks,
stall watchdog, outcome rules and failover loop. The reader demuxes each
message's columns into the attempts' mailboxes and never waits for a
consumer; credit bounds every mailbox. A consumer returns the bytes it took
in batches (a quarter of the window), coalesced into the writer's next
message with pending starts, cancels and detaches.

A worker that answers UNIMPLEMENTED predates the call: it is marked
per-generation (the spares and ``Worker/Generate``, as before) until its
health watch loses it (an upgrade restarts it) or its link is renewed or
dropped; then it is asked again. A link that breaks fails every attempt on it at once
(``WorkerFailed``, kind ``link_<code>``): each generation's failover loop
continues it elsewhere, seq contiguous.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from prometheus_client import Counter

from tokenmesh.errors import label, rpc_error
from tokenmesh.inbox import Inbox
from tokenmesh.links import Link
from tokenmesh.outbox import Outbox
from tokenmesh.retry import Reconnect
from tokenmesh.router._outcome import WorkerFailed
from tokenmesh.tracing import from_mapping, inject
from tokenmesh.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

SETTINGS_WAIT_S = 5.0
"""How long a new link waits for the worker's LinkSettings before it counts as broken."""
DEFAULT_MAX_BATCH_BYTES = 256 * 1024
"""The router's bound on one LinkCommands when the worker's settings name none."""
CHUNK_OVERHEAD = 16
"""Credit a chunk costs beyond its text's bytes (as the worker counts it)."""
LINK = "worker link"
"""The name of the per-peer task that holds a worker's link session."""
STREAM_SPAN = "worker link stream"
"""The client span of a traced attempt on a link (what a Worker/Generate call's RPC span is on the other path)."""

Item = worker_pb2.WorkerEvent | BaseException
"""What an attempt's mailbox holds: the worker's events, then the error that ends the attempt, if any."""


class Attempt(Inbox[worker_pb2.WorkerEvent]):
    """One attempt of a generation on a link: read like a Worker/Generate call (``read``, ``write``, ``cancel``).

    Args:
        session: the link it runs on.
        stream: its id on the link.

    """

    __slots__ = ("_closed", "_session", "span")

    span: trace.Span | None
    """A traced attempt's client span (the worker's generation span is its child); ended when the attempt is."""
    _session: LinkSession
    _closed: bool
    """The router let go of it (cancel())."""

    def __init__(self, session: LinkSession, stream: int) -> None:
        super().__init__(session, stream)
        self._session = session
        self._closed = False
        self.span = None

    def trace(self, tracer: trace.Tracer, parent: dict[str, str], address: str) -> dict[str, str]:
        """Open the attempt's span under parent (the generation's); return the context its start command carries.

        A link carries no per-generation metadata, so there is no RPC span per attempt: this span stands in for
        the one a Worker/Generate call would get, and the worker's generation span is its child.
        """
        host, _, port = address.rpartition(":")
        attributes: dict[str, str | int] = {
            "rpc.system": "grpc",  # a part of the Link call, as the RPC spans say it (not a generation span)
            "rpc.service": "tokenmesh.v1.Worker",
            "rpc.method": "Link",
            "server.address": host,
            "tokenmesh.link.stream": self.stream,
        }
        if port.isdigit():
            attributes["server.port"] = int(port)
        self.span = tracer.start_span(
            STREAM_SPAN, from_mapping(parent), kind=trace.SpanKind.CLIENT, attributes=attributes
        )
        return inject(self.span)

    # -- fed by the session's reader (never awaits) --

    def put(self, item: Item, *, last: bool = False) -> None:
        """An event (or the error that ends the attempt) for the consumer; wake it if it waits."""
        if self.span is not None and isinstance(item, BaseException):
            self.span.set_status(Status(StatusCode.ERROR, str(item)))
        super().put(item, last=last)

    def end(self, end: worker_pb2.LinkEnd) -> None:
        """The worker ended the stream: its end or error event, or the status its own call would have ended with."""
        self.put(end.event if end.HasField("event") else rpc_error(end.status), last=True)
        if self.span is not None and end.event.HasField("error"):
            self.span.set_status(Status(StatusCode.ERROR, end.event.error.message))

    # -- the consumer's side (Relay.run) --

    async def read(self) -> worker_pb2.WorkerEvent:
        """The next event; raises the status or link failure that ended the attempt (CancelledError once cancelled)."""
        if self._closed and not self._mailbox:
            raise asyncio.CancelledError
        item = await self._take()  # cancel() cancels the wait: CancelledError
        if item is None:
            raise asyncio.CancelledError
        if item.HasField("chunk"):
            self._owe(len(item.chunk.text.encode()) + CHUNK_OVERHEAD)
        return item

    async def write(self, command: worker_pb2.WorkerCommand) -> None:
        """Send a start or a cancel as the link's command for this stream (queued for the writer)."""
        if command.WhichOneof("command") == "start":
            self._session.send(worker_pb2.LinkCommand(stream=self.stream, start=command))
        elif not self._ended:
            self._session.send(worker_pb2.LinkCommand(stream=self.stream, cancel=command.cancel))

    def cancel(self) -> bool:
        """Let go: a pending read raises CancelledError (a stall); a stream the worker has not ended is detached.

        Detached, the worker keeps a resumable generation for Resume and cancels any other (as a dropped
        Generate call).
        """
        if self._closed:
            return False
        self._closed = True
        if self.span is not None:
            self.span.end()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.cancel()
        if not self._ended:
            self._session.detach(self.stream)
        return True

    def done(self) -> bool:
        """Whether the attempt is over on the link."""
        return self._ended or self._closed


def _link_commands(
    commands: list[worker_pb2.LinkCommand], credit_stream: list[int], credit_bytes: list[int]
) -> worker_pb2.LinkCommands:
    return worker_pb2.LinkCommands(commands=commands, credit_stream=credit_stream, credit_bytes=credit_bytes)


class LinkSession:
    """One open Worker/Link call: its attempts by stream id, and the commands and credit waiting for the writer.

    Args:
        call: the Link call, its settings read.
        settings: what the worker announced.
        counters: the worker's (messages, chunks) counters, or None.

    """

    call: Any  # a grpc.aio StreamStreamCall (stubs are untyped)
    settings: worker_pb2.LinkSettings
    attempts: dict[int, Attempt]
    grant_at: int
    """Credit owed by an attempt that is returned in one grant: a quarter of the window."""
    _next: int
    outbox: Outbox[worker_pb2.LinkCommand]
    retired: bool
    """Out of ``sessions`` (its link task was cancelled): it serves the attempts on it, and no new ones."""
    _open: bool
    _counters: tuple[Counter, Counter] | None
    """Messages read and the chunks they carried (None: metrics off)."""

    def __init__(
        self, call: Any, settings: worker_pb2.LinkSettings, counters: tuple[Counter, Counter] | None = None
    ) -> None:
        self.call = call
        self.settings = settings
        self._counters = counters
        self.attempts = {}
        self.grant_at = max(1, settings.default_window_bytes // 4)
        self._next = 0
        # Many big prompts queued during one write must not make a message over the call's limit, which would end
        # the link and every stream on it.
        self.outbox = Outbox(_link_commands, settings.max_batch_bytes or DEFAULT_MAX_BATCH_BYTES)
        self._open = True
        self.retired = False

    @property
    def open(self) -> bool:
        """Whether the link still carries attempts (False once it broke)."""
        return self._open

    def attempt(self) -> Attempt:
        """A new stream on the link (started by its first write)."""
        self._next += 1
        attempt = self.attempts[self._next] = Attempt(self, self._next)
        return attempt

    def send(self, command: worker_pb2.LinkCommand) -> None:
        """Queue a command for the writer's next message."""
        self.outbox.send(command)

    def grant(self, stream: int, credit: int) -> None:
        """Return credit to a stream in the writer's next message."""
        self.outbox.grant(stream, credit)

    def detach(self, stream: int) -> None:
        """The router let go of a stream the worker has not ended."""
        if self.attempts.pop(stream, None) is not None and self._open:
            self.send(worker_pb2.LinkCommand(stream=stream, detach=worker_pb2.LinkDetach()))
        self._close_if_done()

    def retire(self) -> None:
        """No new attempts come (the session left ``sessions``): close the call once the last one has ended."""
        self.retired = True
        self._close_if_done()

    def _close_if_done(self) -> None:
        if self.retired and not self.attempts:
            self.call.cancel()  # the worker releases what is left: resumable generations run on for Attach

    async def write_loop(self) -> None:
        """Everything pending when it runs, as one message, until the call ends (the reader fails the attempts)."""
        await self.outbox.write_loop(self.call)

    async def read_loop(self) -> None:
        """Deliver every message to its attempts until the call ends (then raise how it ended)."""
        while True:
            message = await self.call.read()
            if message is grpc.aio.EOF:
                raise ConnectionError("the worker ended the link")
            self._deliver(message)

    def _deliver(self, message: worker_pb2.LinkEvents) -> None:
        attempts = self.attempts
        ttft = message.engine_ttft_ms
        if self._counters is not None:  # two increments a message: the batch size, read off /metrics
            self._counters[0].inc()
            self._counters[1].inc(len(message.chunk_stream))
        for stream, seq, text, tokens in zip(
            message.chunk_stream, message.chunk_seq, message.chunk_text, message.chunk_tokens, strict=False
        ):
            attempt = attempts.get(stream)
            if attempt is None:
                continue  # detached meanwhile
            event = worker_pb2.WorkerEvent(seq=seq, chunk=worker_pb2.TokenChunk(text=text, token_count=tokens))
            if ttft and stream in ttft:
                event.chunk.engine_ttft_ms = ttft[stream]
            attempt.put(event)
        for end in message.ends:
            ended = attempts.pop(end.stream, None)
            if ended is not None:
                ended.end(end)
        if message.ends:
            self._close_if_done()

    def fail(self, failure: WorkerFailed) -> None:
        """The link broke: every attempt on it fails at once (each moves on to another worker)."""
        self._open = False
        attempts, self.attempts = self.attempts, {}
        for attempt in attempts.values():  # an exception each: raised in many tasks, one would share its traceback
            attempt.put(WorkerFailed(str(failure), failure.kind), last=True)


class LinkSessions:
    """The usable link session per worker (none: that worker gets per-generation calls), and what each worker speaks.

    ``run`` is the body of each worker link's ``worker link`` task.
    """

    sessions: dict[str, LinkSession]
    tracer: trace.Tracer | None
    """Opens the stream spans of traced attempts (None: tracing is off, or the Worker service's RPCs get no spans:
    the generation's context goes in the start command as it is)."""
    modes: dict[str, str]
    """Per worker: "batched" (a Link is open), "per-generation" (it answered UNIMPLEMENTED); absent: not known yet."""
    counters: Callable[[str], tuple[Counter, Counter] | None]
    """A worker's (messages, chunks) link counters (the router's metrics; None while they are off)."""
    _serving: set[asyncio.Task[None]]
    """Every session's reader task, retired ones too (held so none is collected while it runs)."""
    _ask_again: dict[str, asyncio.Event]
    """Per worker served per generation: set when it should be asked for a Link again (it went away: a restart)."""

    def __init__(self) -> None:
        self.sessions = {}
        self.tracer = None
        self.modes = {}
        self.counters = lambda _: None
        self._serving = set()
        self._ask_again = {}

    def get(self, address: str) -> LinkSession | None:
        """The worker's open session, if any.

        A session whose link just broke stays in ``sessions`` until its task wakes (a few loop turns later); an
        attempt started on it would hear nothing until the first-token timeout blamed the worker for a stall.
        """
        session = self.sessions.get(address)
        return session if session is not None and session.open else None

    async def run(self, link: Link) -> None:
        """Keep a Link call open to the worker, reopened when it breaks (a per-peer task: runs until cancelled)."""
        reconnect = Reconnect("worker link", link.address, logger=log)
        while True:
            try:
                await self._serve(link, reconnect)
                failure: BaseException = ConnectionError("the worker ended the link")
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    await self._per_generation(link.address)
                failure = exc
            except Exception as exc:  # whatever broke the link, it must not stop the router
                failure = exc
            await reconnect.failed(failure, retry_on=lambda _: True)

    async def _per_generation(self, address: str) -> None:
        """A worker that predates Link: Generate it is, until it is asked again.

        That is when it went away (:meth:`lost`: an upgrade restarts it) or its link is renewed or dropped.
        """
        log.info("worker %s does not serve Worker/Link: one Worker/Generate call per generation", address)
        self.modes[address] = "per-generation"
        ask = self._ask_again[address] = asyncio.Event()
        try:
            await ask.wait()
        finally:
            self.modes.pop(address, None)  # asked again, or gone
            if self._ask_again.get(address) is ask:
                del self._ask_again[address]

    def lost(self, address: str) -> None:
        """The worker's health watch lost it (a restart, an upgrade in place).

        One served per generation is asked for a Link again (its link task retries until it is back).
        """
        ask = self._ask_again.get(address)
        if ask is not None:
            ask.set()

    async def _serve(self, link: Link, reconnect: Reconnect) -> None:
        """Open the worker's Link and serve it until it breaks (raising how).

        When this task is cancelled (the worker dropped, its channel renewed, the router stopping), the session
        takes no new attempts but keeps serving the ones on it: the task ends once they have ended and the call is
        closed (or its channel was), so a renewal closes the old channel only then.
        """
        call = link.stub(worker_pb2_grpc.WorkerStub).Link()
        try:
            first = await asyncio.wait_for(call.read(), SETTINGS_WAIT_S)
            if first is grpc.aio.EOF or not first.HasField("settings"):
                raise ConnectionError("the worker ended the link before its settings")
        except BaseException:
            call.cancel()
            raise
        session = self.sessions[link.address] = LinkSession(call, first.settings, self.counters(link.address))
        self.modes[link.address] = "batched"
        reconnect.connected()
        serving = asyncio.create_task(_serve_session(session), name=f"worker link {link.address}")
        self._serving.add(serving)
        serving.add_done_callback(self._serving.discard)
        serving.add_done_callback(_ended)
        try:
            await asyncio.shield(serving)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and not task.cancelling():  # the call was cancelled under it, not this task
                raise ConnectionError("the link's call was cancelled") from None
            self._retire(link.address, session)
            await asyncio.wait({serving})  # drain: no new starts, the streams on it finish, then its call closes
            raise
        finally:
            self._retire(link.address, session)

    def _retire(self, address: str, session: LinkSession) -> None:
        """The session takes no new attempts (the ones on it run to their end, then it closes its call)."""
        if self.sessions.get(address) is session:
            del self.sessions[address]
            self.modes.pop(address, None)  # not known again until the next session opens
        session.retire()


def _ended(task: asyncio.Task[None]) -> None:
    """Take the outcome of a session's task whose link task was cancelled meanwhile (nobody else awaits it)."""
    if not task.cancelled():
        task.exception()


async def _serve_session(session: LinkSession) -> None:
    """One session's reader and writer; when the call ends, every attempt still on it fails (and moves on)."""
    writer = asyncio.create_task(session.write_loop())
    failure = WorkerFailed("the link to the worker was closed", "link_closed")
    try:
        await session.read_loop()
    except grpc.aio.AioRpcError as exc:
        failure = WorkerFailed(f"link broke: {exc.code().name}: {exc.details()}", f"link_{label(exc.code())}")
        raise
    except ConnectionError as exc:
        failure = WorkerFailed(str(exc), "link_closed")
        raise
    finally:
        writer.cancel()
        session.call.cancel()
        session.fail(failure)
