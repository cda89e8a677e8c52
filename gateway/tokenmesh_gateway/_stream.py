"""One generation answered over HTTP: the status after the first chunk, then SSE events or one body.

The HTTP status waits for the mesh's first chunk, so a request the router
refuses (bad input, unknown model, queue full, no worker) is a real 4xx/5xx
with the OpenAI error body; an error after the first chunk is an error event
and the end of the stream.

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
from dataclasses import dataclass

from tokenmesh.errors import MeshError
from tokenmesh.v1 import inference_pb2
from tokenmesh_gateway._errors import DEFAULT_RETRY_AFTER_MS, HttpError, from_mesh
from tokenmesh_gateway._http import SSE_HEADERS, Receive, Send, respond, respond_error
from tokenmesh_gateway._openai import Kind
from tokenmesh_gateway._sse import DONE, KEEPALIVE, Encoder, completion_body, error_event

log = logging.getLogger(__name__)

Chunks = AsyncGenerator[inference_pb2.GenerateChunk, None]


@dataclass(frozen=True, slots=True)
class Answer:
    """How to answer one request."""

    kind: Kind
    stream: bool
    include_usage: bool
    continuous_usage: bool
    model: str
    """The model to name when the mesh's chunks name none."""
    created: int
    """The response's ``created``."""
    id_prefix: str = ""
    """What the mesh's request ids carry in front of the caller's (its tenant); the caller never sees it."""

    def visible_id(self, chunk: inference_pb2.GenerateChunk) -> str:
        """The request id as the caller knows it."""
        return chunk.request_id.removeprefix(self.id_prefix)


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
                    await respond_error(send, from_mesh(error))
                    return
                except StopAsyncIteration:
                    exchange.finishing()
                    await respond_error(
                        send, HttpError(502, "the mesh ended the stream before its first chunk", code="internal")
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
                await self._stopped(exchange, send)
        except Exception:
            # A fault of ours (or of a library): this caller gets a 500, every other stream goes on.
            log.exception("gateway: exchange failed")
            exchange.finishing()
            failed = HttpError(500, "the gateway failed on this request; see its log", code="internal")
            with contextlib.suppress(Exception):
                if exchange.started:
                    await send({"type": "http.response.body", "body": error_event(failed), "more_body": False})
                else:
                    await respond_error(send, failed)
        finally:
            if exchange.watcher is not None:
                exchange.watcher.cancel()
            self.active.discard(exchange)
            if not self.active:
                self.idle.set()

    async def _stream(
        self, exchange: Exchange, first: inference_pb2.GenerateChunk, chunks: Chunks, answer: Answer, send: Send
    ) -> None:
        request_id = answer.visible_id(first)
        encoder = Encoder(
            answer.kind,
            request_id,
            answer.created,
            first.model or answer.model,
            include_usage=answer.include_usage,
            continuous_usage=answer.continuous_usage,
        )
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*SSE_HEADERS, (b"x-request-id", request_id.encode())],
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
                await send({"type": "http.response.body", "body": encoder.chunk(chunk) + DONE, "more_body": False})
                return
            else:
                error = HttpError(502, "the mesh ended the stream without its final chunk", code="internal")
        except MeshError as exc:
            error = from_mesh(exc)
        exchange.finishing()
        await send({"type": "http.response.body", "body": error_event(error), "more_body": False})

    @staticmethod
    async def _collect(
        exchange: Exchange, first: inference_pb2.GenerateChunk, chunks: Chunks, answer: Answer, send: Send
    ) -> None:
        texts = [first.text]
        last = first
        try:
            if not first.finish_reason:
                async for chunk in chunks:
                    texts.append(chunk.text)
                    last = chunk
                    if chunk.finish_reason:
                        break
        except MeshError as error:
            exchange.finishing()
            await respond_error(send, from_mesh(error))
            return
        exchange.finishing()
        request_id = answer.visible_id(first)
        if last.finish_reason in (inference_pb2.FINISH_REASON_UNSPECIFIED, inference_pb2.FINISH_REASON_ERROR):
            await respond_error(send, HttpError(500, f"generation {request_id} failed", code="internal"))
            return
        body = completion_body(
            answer.kind,
            request_id,
            answer.created,
            last.model or answer.model,
            "".join(texts),
            last.finish_reason,
            last.usage.prompt_tokens,
            last.usage.completion_tokens,
        )
        await respond(send, 200, body, [(b"x-request-id", request_id.encode())])

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
    async def _stopped(exchange: Exchange, send: Send) -> None:
        """What a caller whose exchange the gateway's stop ended gets."""
        error = HttpError(
            503,
            "this gateway is shutting down; send the request again (a stream started with "
            "X-Request-Id resumes with Last-Event-ID on another gateway)",
            code="unavailable",
            retry_after_ms=DEFAULT_RETRY_AFTER_MS,
        )
        if exchange.started:
            await send({"type": "http.response.body", "body": error_event(error), "more_body": False})
        else:
            await respond_error(send, error)

    async def drain(self, grace_s: float, tail_s: float) -> None:
        """Wait up to grace_s for the exchanges in flight to end, then end the rest, giving them tail_s."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.idle.wait(), grace_s)
        for exchange in list(self.active):
            exchange.stopping = True
            exchange.task.cancel()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.idle.wait(), tail_s)
