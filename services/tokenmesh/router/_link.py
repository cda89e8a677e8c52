"""The router's side of ``Worker/Link``: one call per worker carrying every generation this router runs there.

The caller end of :mod:`tokenmesh.mux`. Each attempt of a generation is an
:class:`Attempt`, which :meth:`~tokenmesh.router._relay.Relay.run` reads as
any :class:`~tokenmesh.router._transport.WorkerStream`: the same seq checks,
stall watchdog, outcome rules and failover loop as on a ``Worker/Generate``
call. A link that breaks fails every attempt on it at once (``WorkerFailed``,
kind ``link_<code>``): each generation's failover loop continues it
elsewhere, seq contiguous. Which worker gets a link, and reopening it, is
:mod:`tokenmesh.router._transport`'s.
"""

from __future__ import annotations

import asyncio

import grpc
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from prometheus_client import Counter

from tokenmesh.errors import label, rpc_error
from tokenmesh.mux import DEFAULT_MAX_BATCH_BYTES, DEFAULT_WINDOW_BYTES, CallerSession, Inbox, cost
from tokenmesh.router._outcome import WorkerFailed
from tokenmesh.tracing import from_mapping, inject
from tokenmesh.v1 import worker_pb2

STREAM_SPAN = "worker link stream"
"""The client span of a traced attempt on a link (what a Worker/Generate call's RPC span is on the other path)."""


class Attempt(Inbox[worker_pb2.WorkerEvent]):
    """One attempt of a generation on a link, read as a Worker/Generate call is (``read``, ``write``, ``cancel``).

    Args:
        session: the link it runs on.
        stream: its id on the link.

    """

    __slots__ = ("span",)

    stops_on_close = True
    """Letting go detaches the stream, which stops a generation that is not resumable (as the link's end does)."""
    span: trace.Span | None
    """A traced attempt's client span (the worker's generation span is its child); ended when the attempt is."""
    _session: LinkSession

    def __init__(self, session: LinkSession, stream: int) -> None:
        super().__init__(session, stream)
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

    def put(self, item: worker_pb2.WorkerEvent | BaseException, *, last: bool = False) -> None:
        """An event (or the error that ends the attempt) for the consumer; wake it if it waits."""
        if self.span is not None:
            if isinstance(item, BaseException):
                self.span.set_status(Status(StatusCode.ERROR, str(item)))
            elif item.HasField("error"):
                self.span.set_status(Status(StatusCode.ERROR, item.error.message))
        super().put(item, last=last)

    async def read(self) -> worker_pb2.WorkerEvent:
        """The next event; raises the status or link failure that ended the attempt (CancelledError once cancelled)."""
        item = await self._take()
        if item is None:
            raise asyncio.CancelledError
        if item.HasField("chunk"):
            self._owe(cost(item.chunk.text))
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
        if not self._close():
            return False
        if self.span is not None:
            self.span.end()
        if not self._ended:
            self._session.detach(self.stream)
        return True


def _link_commands(
    commands: list[worker_pb2.LinkCommand], credit_stream: list[int], credit_bytes: list[int]
) -> worker_pb2.LinkCommands:
    return worker_pb2.LinkCommands(commands=commands, credit_stream=credit_stream, credit_bytes=credit_bytes)


class LinkSession(CallerSession[worker_pb2.LinkCommand, Attempt]):
    """One open Worker/Link call: its attempts by stream id, and the commands and credit waiting for the writer.

    Args:
        call: the Link call, its settings read.
        settings: what the worker announced.
        counters: the worker's (messages, chunks) counters, or None.

    """

    settings: worker_pb2.LinkSettings
    _counters: tuple[Counter, Counter] | None
    """Messages read and the chunks they carried (None: metrics off)."""

    def __init__(
        self, call: object, settings: worker_pb2.LinkSettings, counters: tuple[Counter, Counter] | None = None
    ) -> None:
        # Many big prompts queued during one write must not make a message over the call's limit, which would end
        # the link and every stream on it.
        window = settings.default_window_bytes or DEFAULT_WINDOW_BYTES
        super().__init__(call, window, settings.max_batch_bytes or DEFAULT_MAX_BATCH_BYTES, _link_commands)
        self.settings = settings
        self._counters = counters

    def attempt(self) -> Attempt:
        """A new stream on the link (started by its first write)."""
        return self.add(lambda stream: Attempt(self, stream))

    def detached(self, stream: int) -> worker_pb2.LinkCommand:
        """The router let go of a stream the worker has not ended."""
        return worker_pb2.LinkCommand(stream=stream, detach=worker_pb2.LinkDetach())

    def demux(self, message: worker_pb2.LinkEvents) -> None:
        """One message's chunks and ends into the attempts' mailboxes (a detached attempt is skipped)."""
        attempts = self.streams
        ttft = message.engine_ttft_ms
        if self._counters is not None:  # two increments a message: the batch size, read off /metrics
            self._counters[0].inc()
            self._counters[1].inc(len(message.chunk_stream))
        logprobs = message.chunk_logprobs
        for index, (stream, seq, text, tokens) in enumerate(
            zip(message.chunk_stream, message.chunk_seq, message.chunk_text, message.chunk_tokens, strict=False)
        ):
            attempt = attempts.get(stream)
            if attempt is None:
                continue  # detached meanwhile
            event = worker_pb2.WorkerEvent(seq=seq, chunk=worker_pb2.TokenChunk(text=text, token_count=tokens))
            if ttft and stream in ttft:
                event.chunk.engine_ttft_ms = ttft[stream]
            if logprobs and index in logprobs:
                event.chunk.logprobs.extend(logprobs[index].tokens)
            attempt.put(event)
        for end in message.ends:
            self.end(end.stream, end.event if end.HasField("event") else rpc_error(end.status))

    def broken(self, failure: BaseException | None) -> WorkerFailed:
        """The link broke: each attempt fails as its worker's failure (and moves on to another worker)."""
        if isinstance(failure, grpc.aio.AioRpcError):
            code = failure.code()
            return WorkerFailed(f"link broke: {code.name}: {failure.details()}", f"link_{label(code)}")
        if failure is None:
            return WorkerFailed("the worker ended the link", "link_closed")
        if isinstance(failure, ConnectionError):
            return WorkerFailed(str(failure), "link_closed")
        return WorkerFailed("the link to the worker was closed", "link_closed")
