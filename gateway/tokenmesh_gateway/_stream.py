"""One generation answered over HTTP: the status after the first chunk, then SSE events or one body.

The HTTP status waits for the mesh's first chunk, so a request the router
refuses (bad input, unknown model, queue full, no worker) is a real 4xx/5xx
with the API's error body; an error after the first chunk is an error event
and the end of the stream. What the bytes look like is the :class:`Answer`'s
(OpenAI's format in ``_sse``, Anthropic's in ``_anthropic_sse``): this module
only runs the exchange.

Each exchange has one watcher task beside the request's own: it reads the
ASGI receive channel, so a caller that goes away is noticed at once, also
while no token flows, and writes the keep-alive comment after
``keepalive_s`` of silence. On a disconnect it cancels the request's task:
the cancellation runs through :class:`tokenmesh.client.Client`'s iterator
and its gRPC call, so a generation whose id the gateway let the client make
up is cancelled (router → worker → Triton), and one started with the
caller's ``X-Request-Id`` detaches and stays resumable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Protocol

from tokenmesh.errors import MeshError
from tokenmesh.v1 import inference_pb2
from tokenmesh_gateway._errors import DEFAULT_RETRY_AFTER_MS, ErrorShape, HttpError, from_mesh
from tokenmesh_gateway._http import KEEPALIVE, SSE_HEADERS, Receive, Send, respond, respond_error
from tokenmesh_gateway._ratelimits import admitted_headers

log = logging.getLogger(__name__)

Chunks = AsyncGenerator[inference_pb2.GenerateChunk, None]


class StreamEncoder(Protocol):
    """The SSE events of one streamed response, in one API's format."""

    def chunk(self, chunk: inference_pb2.GenerateChunk) -> bytes:
        """The events of a chunk that is not the last (the first one opens the stream)."""
        ...

    def last(self, chunk: inference_pb2.GenerateChunk) -> bytes:
        """The events of the final chunk, up to the end of the stream."""
        ...


class Answer(Protocol):
    """How to answer one request, in one API's format (OpenAI's in ``_sse``, Anthropic's in ``_anthropic_sse``)."""

    @property
    def stream(self) -> bool:
        """Server-Sent Events; else one body."""
        ...

    @property
    def id_prefix(self) -> str:
        """What the mesh's request ids carry in front of the caller's (its tenant); the caller never sees it."""
        ...

    @property
    def errors(self) -> ErrorShape:
        """How this API writes an error response."""
        ...

    def encoder(self, request_id: str, model: str) -> StreamEncoder:
        """The events of the stream of request_id; model is the first chunk's (may be empty)."""
        ...

    def whole(self, request_id: str, text: str, last: inference_pb2.GenerateChunk) -> bytes:
        """The non-streamed body of a generation that ended as last says; HttpError if that is no answer."""
        ...

    def error_event(self, error: HttpError) -> bytes:
        """An error after the stream began, up to the end of the stream."""
        ...


def visible_id(answer: Answer, chunk: inference_pb2.GenerateChunk) -> str:
    """The request id as the caller knows it."""
    return chunk.request_id.removeprefix(answer.id_prefix)


class Exchange:
    """One request in flight that runs or resumes a generation.

    Args:
        task: the request's task (cancelled when the caller goes away or the gateway stops).

    """

    task: asyncio.Task[object]
    watcher: asyncio.Task[None] | None
    disconnected: bool
    """The caller went away."""
    stopping: bool
    """The gateway is stopping and ended this exchange."""
    started: bool
    """The response's headers are sent."""
    last_write: float
    """When the last bytes were sent (loop time)."""

    def __init__(self, task: asyncio.Task[object]) -> None:
        self.task = task
        self.watcher = None
        self.disconnected = False
        self.stopping = False
        self.started = False
        self.last_write = 0.0

    def finishing(self) -> None:
        """The last bytes go out next: no keep-alive, no cancel from now on."""
        if self.watcher is not None:
            self.watcher.cancel()
            self.watcher = None


class Exchanges:
    """Every exchange in flight: each streamed or answered whole, watched, drained on shutdown.

    Args:
        keepalive_s: silence after which a stream gets a keep-alive comment.

    """

    keepalive_s: float
    active: set[Exchange]
    idle: asyncio.Event
    """Set while no exchange is in flight."""

    def __init__(self, keepalive_s: float) -> None:
        self.keepalive_s = keepalive_s
        self.active = set()
        self.idle = asyncio.Event()
        self.idle.set()

    async def answer(self, open_chunks: Callable[[], Chunks], answer: Answer, receive: Receive, send: Send) -> None:
        """Run the generation open_chunks starts and answer it; returns when the exchange is over."""
        task = asyncio.current_task()
        assert task is not None
        exchange = Exchange(task)
        exchange.watcher = asyncio.create_task(self._watch(exchange, receive, send))
        self.active.add(exchange)
        self.idle.clear()
        try:
            chunks = open_chunks()
            async with contextlib.aclosing(chunks):
                try:
                    first = await anext(chunks)
                except MeshError as error:
                    exchange.finishing()
                    await respond_error(send, from_mesh(error), answer.errors)
                    return
                except StopAsyncIteration:
                    exchange.finishing()
                    await respond_error(
                        send,
                        HttpError(502, "the mesh ended the stream before its first chunk", code="internal"),
                        answer.errors,
                    )
                    return
                if answer.stream:
                    await self._stream(exchange, first, chunks, answer, send)
                else:
                    await self._collect(exchange, first, chunks, answer, send)
        except asyncio.CancelledError:
            if not (exchange.disconnected or exchange.stopping) or task.uncancel() > 0:
                raise
            if exchange.stopping and not exchange.disconnected:
                await self._stopped(exchange, answer, send)
        except Exception:
            # A fault of ours (or of a library): this caller gets a 500, every other stream goes on.
            log.exception("gateway: exchange failed")
            exchange.finishing()
            failed = HttpError(500, "the gateway failed on this request; see its log", code="internal")
            with contextlib.suppress(Exception):
                if exchange.started:
                    await send({"type": "http.response.body", "body": answer.error_event(failed), "more_body": False})
                else:
                    await respond_error(send, failed, answer.errors)
        finally:
            if exchange.watcher is not None:
                exchange.watcher.cancel()
            self.active.discard(exchange)
            if not self.active:
                self.idle.set()

    async def _stream(
        self, exchange: Exchange, first: inference_pb2.GenerateChunk, chunks: Chunks, answer: Answer, send: Send
    ) -> None:
        request_id = visible_id(answer, first)
        encoder = answer.encoder(request_id, first.model)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*SSE_HEADERS, (b"x-request-id", request_id.encode()), *admitted_headers(first)],
            }
        )
        loop = asyncio.get_running_loop()
        exchange.started, exchange.last_write = True, loop.time()
        chunk = first
        try:
            if not first.finish_reason:
                await send({"type": "http.response.body", "body": encoder.chunk(first), "more_body": True})
                # The hot loop: per chunk, one encode and one write, nothing else.
                async for chunk in chunks:
                    if chunk.finish_reason:
                        break
                    await send({"type": "http.response.body", "body": encoder.chunk(chunk), "more_body": True})
                    exchange.last_write = loop.time()
            if chunk.finish_reason == inference_pb2.FINISH_REASON_ERROR:
                error = HttpError(500, f"generation {request_id} failed", code="internal")
            elif chunk.finish_reason:
                exchange.finishing()
                await send({"type": "http.response.body", "body": encoder.last(chunk), "more_body": False})
                return
            else:
                error = HttpError(502, "the mesh ended the stream without its final chunk", code="internal")
        except MeshError as exc:
            error = from_mesh(exc)
        exchange.finishing()
        await send({"type": "http.response.body", "body": answer.error_event(error), "more_body": False})

    @staticmethod
    async def _collect(
        exchange: Exchange, first: inference_pb2.GenerateChunk, chunks: Chunks, answer: Answer, send: Send
    ) -> None:
        texts = [first.text]
        logprobs = list(first.logprobs)
        last = first
        try:
            if not first.finish_reason:
                async for chunk in chunks:
                    texts.append(chunk.text)
                    logprobs.extend(chunk.logprobs)
                    last = chunk
                    if chunk.finish_reason:
                        break
        except MeshError as error:
            exchange.finishing()
            await respond_error(send, from_mesh(error), answer.errors)
            return
        exchange.finishing()
        request_id = visible_id(answer, first)
        try:
            if last.finish_reason in (inference_pb2.FINISH_REASON_UNSPECIFIED, inference_pb2.FINISH_REASON_ERROR):
                raise HttpError(500, f"generation {request_id} failed", code="internal")
            if logprobs and last is not first:  # the final chunk carries every token's for the whole answer
                last.ClearField("logprobs")
                last.logprobs.extend(logprobs)
            body = answer.whole(request_id, "".join(texts), last)
        except HttpError as error:
            await respond_error(send, error, answer.errors)
            return
        await respond(send, 200, body, [(b"x-request-id", request_id.encode()), *admitted_headers(first)])

    async def _watch(self, exchange: Exchange, receive: Receive, send: Send) -> None:
        """Until the caller goes away (then cancel the exchange), with a keep-alive after each silence."""
        loop = asyncio.get_running_loop()
        while True:
            wait = self.keepalive_s
            if exchange.started:
                wait = max(0.01, wait - (loop.time() - exchange.last_write))
            try:
                async with asyncio.timeout(wait):  # no task of its own (wait_for makes one per wait)
                    message = await receive()
            except TimeoutError:
                if exchange.started and loop.time() - exchange.last_write >= self.keepalive_s:
                    exchange.last_write = loop.time()
                    await send({"type": "http.response.body", "body": KEEPALIVE, "more_body": True})
                continue
            if message["type"] == "http.disconnect":
                exchange.disconnected = True
                exchange.watcher = None
                exchange.task.cancel()
                return

    @staticmethod
    async def _stopped(exchange: Exchange, answer: Answer, send: Send) -> None:
        """What a caller whose exchange the gateway's stop ended gets."""
        error = HttpError(
            503,
            "this gateway is shutting down; send the request again (a stream started with "
            "X-Request-Id resumes with Last-Event-ID on another gateway)",
            code="unavailable",
            retry_after_ms=DEFAULT_RETRY_AFTER_MS,
        )
        if exchange.started:
            await send({"type": "http.response.body", "body": answer.error_event(error), "more_body": False})
        else:
            await respond_error(send, error, answer.errors)

    async def drain(self, grace_s: float, tail_s: float) -> None:
        """Wait up to grace_s for the exchanges in flight to end, then end the rest, giving them tail_s."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.idle.wait(), grace_s)
        for exchange in list(self.active):
            exchange.stopping = True
            exchange.task.cancel()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.idle.wait(), tail_s)
