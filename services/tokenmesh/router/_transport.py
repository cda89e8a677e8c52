"""How the router reaches each worker: one transport, whichever road an attempt takes below it.

:class:`WorkerTransports` is built and owned by the router service: it keeps
a ``Worker/Link`` open to each worker it is told to watch (the default road,
:mod:`tokenmesh.router._link`), falls back to one ``Worker/Generate`` call per
generation for a worker that predates Link (the spares,
:mod:`tokenmesh.router._spares`), is told when a worker is lost, and hands
each attempt a :class:`WorkerStream`. Nothing above it asks which road an
attempt took.

A worker that answers UNIMPLEMENTED predates Link: it is marked
per-generation until its health watch loses it (an upgrade restarts it) or
its link is renewed or dropped; then it is asked again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

import grpc
from opentelemetry import trace
from prometheus_client import Counter

from tokenmesh.links import Link, Links
from tokenmesh.mux import read_settings
from tokenmesh.retry import Reconnect
from tokenmesh.router._link import LinkSession
from tokenmesh.router._spares import Spares
from tokenmesh.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

LINK = "worker link"
"""The name of the per-peer task that holds a worker's link session."""


class WorkerStream(Protocol):
    """One attempt's stream from its worker, read as a ``Worker/Generate`` call is, on either road."""

    stops_on_close: bool
    """Whether letting go stops a generation that is not resumable (else the router cancels it by request_id)."""

    async def write(self, command: worker_pb2.WorkerCommand) -> None:
        """Send the start, or a cancel."""

    async def read(self) -> Any:
        """The next WorkerEvent (or ``grpc.aio.EOF``); raises how the stream broke."""

    def cancel(self) -> bool:
        """Let go of the stream (a pending read raises CancelledError)."""


async def stop(call: WorkerStream) -> None:
    """Tell the worker to stop the attempt's generation (a cancel command on its stream)."""
    await call.write(worker_pb2.WorkerCommand(cancel=worker_pb2.CancelGeneration(reason="Cancel")))


class WorkerTransports:
    """The road to each worker: its link session while one is open, per-generation calls otherwise.

    Args:
        links: the router's links to its workers.
        batched: open a Link to each watched worker (``--worker-link auto``); False: every attempt is a
            ``Worker/Generate`` call.
        tracer: opens the stream spans of traced attempts on a link (None: tracing is off, or the Worker
            service's RPCs get no spans: the generation's context goes in the start command as it is).
        counters: a worker's (messages, chunks) link counters (the router's metrics; None while they are off).

    """

    links: Links
    spares: Spares
    sessions: dict[str, LinkSession]
    modes: dict[str, str]
    """Per worker: "batched" (a Link is open), "per-generation" (it answered UNIMPLEMENTED); absent: not known yet."""
    _batched: bool
    _tracer: trace.Tracer | None
    _counters: Callable[[str], tuple[Counter, Counter] | None]
    _serving: set[asyncio.Task[None]]
    """Every session's task, retired ones too (held so none is collected while it runs)."""
    _ask_again: dict[str, asyncio.Event]
    """Per worker served per generation: set when it should be asked for a Link again (it went away: a restart)."""

    def __init__(
        self,
        links: Links,
        *,
        batched: bool = True,
        tracer: trace.Tracer | None = None,
        counters: Callable[[str], tuple[Counter, Counter] | None] = lambda _: None,
    ) -> None:
        self.spares = Spares(links)
        self.sessions = {}
        self.modes = {}
        self.links = links
        self._batched = batched
        self._tracer = tracer
        self._counters = counters
        self._serving = set()
        self._ask_again = {}

    def watch(self, link: Link, options: Any) -> None:
        """A new worker link: keep a Link call open on it (with ``batched``)."""
        if self._batched:
            link.run(LINK, self._run, options=options)

    def mode(self, address: str) -> str:
        """How generations reach the worker (RoutingEntry.link)."""
        return self.modes.get(address, "") if self._batched else "per-generation"

    def open(self, address: str, start: worker_pb2.WorkerCommand, trace_context: dict[str, str] | None) -> WorkerStream:
        """An attempt's stream: on the worker's Link when one is open, else a Generate call.

        A link carries no per-generation metadata: a traced attempt's context goes in its start command.
        A session whose link just broke stays in ``sessions`` until its task wakes (a few loop turns later); an
        attempt started on it would hear nothing until the first-token timeout blamed the worker for a stall.
        """
        session = self.sessions.get(address)
        if session is None or not session.open:
            return self.spares.take(address, trace_context)
        attempt = session.attempt()
        if trace_context:  # traced: the attempt's own span is the worker's parent, as a Generate call's RPC span
            tracer = self._tracer
            start.trace_context.update(
                trace_context if tracer is None else attempt.trace(tracer, trace_context, address)
            )
        return attempt

    def lost(self, address: str) -> None:
        """The worker's health watch lost it (a restart, an upgrade in place).

        One served per generation is asked for a Link again (its link task retries until it is back).
        """
        ask = self._ask_again.get(address)
        if ask is not None:
            ask.set()

    async def _run(self, link: Link) -> None:
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
        """A worker that predates Link: Generate it is, until it is asked again (:meth:`lost`, or a new link)."""
        log.info("worker %s does not serve Worker/Link: one Worker/Generate call per generation", address)
        self.modes[address] = "per-generation"
        ask = self._ask_again[address] = asyncio.Event()
        try:
            await ask.wait()
        finally:
            self.modes.pop(address, None)  # asked again, or gone
            if self._ask_again.get(address) is ask:
                del self._ask_again[address]

    async def _serve(self, link: Link, reconnect: Reconnect) -> None:
        """Open the worker's Link and serve it until it breaks (raising how).

        When this task is cancelled (the worker dropped, its channel renewed, the router stopping), the session
        takes no new attempts but keeps serving the ones on it: the task ends once they have ended and the call is
        closed (or its channel was), so a renewal closes the old channel only then.
        """
        call = link.stub(worker_pb2_grpc.WorkerStub).Link()
        settings = await read_settings(call, "the worker")
        session = self.sessions[link.address] = LinkSession(call, settings, self._counters(link.address))
        self.modes[link.address] = "batched"
        reconnect.connected()
        serving = asyncio.create_task(session.serve(), name=f"worker link {link.address}")
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
