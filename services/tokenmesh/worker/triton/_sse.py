"""One generation on the worker's own Triton over HTTP: ``generate_stream``, read as server-sent events.

Why not gRPC here: Triton streams one response per token (as its vLLM
backend does), and a grpc.aio read costs one completion-queue event and one
Python wake-up per message however small it is: ~120 us of the worker's CPU
per token on the 2-core test machine. Over HTTP/1.1 the same responses are
SSE events on one socket, and one read takes every event that has arrived
(~35 us per token measured the same way: ``benchmarks/README.md``, "The
worker's read of Triton"). Triton's HTTP server cancels a streaming request
when its connection closes, so closing the socket is the cancel.

Our own Triton only (loopback, plaintext): a Triton given by URL is reached
over gRPC (:mod:`._generation`), which carries TLS and mTLS.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any, cast

import httptools
import orjson

from tokenmesh.errors import classify_backend_message
from tokenmesh.v1 import worker_pb2
from tokenmesh.worker._backend import BackendError, Delta, Finished, Generation, GenerationParams
from tokenmesh.worker.triton._codec import flags, last_events, logprobs_of, messages_json, sampling_parameters

_EVENT_END = b"\n\n"
_DATA = b"data: "
_HELD_EVENTS = 1024
"""Events parsed and not yet taken at which the socket stops being read (the rest waits in the kernel's buffers,
then in Triton's: its HTTP server queues what it cannot write, so this bounds the worker's memory, not Triton's)."""


def _http_request(host: str, port: int, params: GenerationParams) -> bytes:
    """The whole HTTP/1.1 request: the vLLM-backend inputs as JSON, the trace context as headers.

    The same inputs as the gRPC path's tensors (``_codec.build_request``), from the same helpers.
    """
    fields: dict[str, Any] = {
        "id": params.request_id,
        "text_input": params.prompt,
        "stream": True,
        "sampling_parameters": json.dumps(sampling_parameters(params)),
    }
    if params.messages:
        fields["messages"] = messages_json(params)
    for flag in flags(params):
        fields[flag] = True
    body = orjson.dumps(fields)
    head = [
        f"POST /v2/models/{params.model}/generate_stream HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Type: application/json",
        "Accept: text/event-stream",
        f"Content-Length: {len(body)}",
        *(f"{key}: {value}" for key, value in params.trace_context),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class _Exchange(asyncio.Protocol):
    """One request written, its response parsed as it arrives: status, then SSE events in order."""

    def __init__(self, request: bytes) -> None:
        self._request = request
        self._parser = httptools.HttpResponseParser(self)
        self._partial = b""
        self._transport: asyncio.Transport | None = None
        self._closing = False
        self._paused = False
        self._wake: asyncio.Future[None] | None = None
        self.events: list[bytes] = []
        """``data:`` payloads parsed and not yet taken."""
        self.status = 0
        self.complete = False
        """The response ended as HTTP says it must (the final chunk came)."""
        self.closed = False
        self.broken: str | None = None
        """Why the bytes could not be parsed as HTTP, if they could not."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport
        if self._closing:  # cancelled while connecting: never send the request
            transport.close()
            return
        transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.broken = str(exc)
            self.close()
        self._notify()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._notify()

    def on_headers_complete(self) -> None:  # httptools callback
        self.status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:  # httptools callback
        chunk = self._partial + body if self._partial else body
        *events, self._partial = chunk.split(_EVENT_END)
        self.events.extend(event[len(_DATA) :] for event in events if event.startswith(_DATA))
        if len(self.events) >= _HELD_EVENTS and self._transport is not None and not self._paused:
            # A reader behind (the worker's loop busy): leave the rest in the socket, not in this list.
            self._paused = True
            self._transport.pause_reading()

    @property
    def rest(self) -> bytes:
        """Body bytes that are no complete event: all of a refusal's plain JSON body."""
        return self._partial

    def take(self) -> list[bytes]:
        """The events parsed so far, in order; reading resumes if they had filled the hold."""
        events, self.events = self.events, []
        if self._paused and self._transport is not None and not self._closing:
            self._paused = False
            self._transport.resume_reading()
        return events

    def on_message_complete(self) -> None:  # httptools callback
        self.complete = True
        self.close()

    def close(self) -> None:
        """Close the socket: Triton cancels the request if it still runs."""
        self._closing = True
        if self._transport is not None:
            self._transport.close()

    async def wait(self) -> None:
        """Until there are events to take, or the exchange ended."""
        if self.events or self.closed:
            return
        self._wake = asyncio.get_running_loop().create_future()
        try:
            await self._wake
        finally:
            self._wake = None

    def _notify(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)


class TritonSseGeneration(Generation):
    """One ``generate_stream`` request on our own Triton; cancelling it closes the socket, which cancels it there."""

    def __init__(self, host: str, port: int, params: GenerationParams) -> None:
        self._host = host
        self._port = port
        self._params = params
        self._exchange: _Exchange | None = None
        self._cancelled = False
        self._timed_out = False

    def cancel(self) -> None:
        """Close the connection: Triton marks the request cancelled, the model stops."""
        self._cancelled = True
        if self._exchange is not None:
            self._exchange.close()

    async def __aiter__(self) -> AsyncIterator[Delta | Finished]:
        """Deltas as Triton streams them, then Finished (or BackendError)."""
        if self._cancelled:
            yield Finished("cancelled", 0, 0)
            return
        params = self._params
        exchange = self._exchange = _Exchange(_http_request(self._host, self._port, params))
        streamed = _Streamed(self._params.logprobs)
        loop = asyncio.get_running_loop()
        deadline = None if params.timeout_s is None else loop.time() + params.timeout_s
        # The deadline closes the socket (one timer, not one per read); it never cancels our consumer's task.
        timer = None if deadline is None else loop.call_at(deadline, self._time_out)
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    await loop.create_connection(lambda: exchange, self._host, self._port)
            except (OSError, TimeoutError) as exc:
                if not self._cancelled:
                    raise self._unreachable(exc) from exc
            else:
                async for data in _payloads(exchange):
                    for event in streamed.events(data):
                        yield event
                    if streamed.finished:
                        return
        finally:
            if timer is not None:
                timer.cancel()
            exchange.close()  # no-op once Triton ended the response
        yield self._ended(exchange, streamed)

    def _time_out(self) -> None:
        self._timed_out = True
        if self._exchange is not None:
            self._exchange.close()

    def _unreachable(self, exc: BaseException) -> BackendError:
        if self._timed_out or isinstance(exc, TimeoutError):
            return self._timeout()
        return BackendError(
            worker_pb2.ERROR_CLASS_UNAVAILABLE, f"Triton: cannot reach {self._host}:{self._port}: {exc}"
        )

    def _timeout(self) -> BackendError:
        return BackendError(
            worker_pb2.ERROR_CLASS_TIMEOUT, f"Triton: no end within the generation's {self._params.timeout_s:g} s"
        )

    def _ended(self, exchange: _Exchange, streamed: _Streamed) -> Finished:
        """How a response that ended without a final event ends the generation (or why it fails)."""
        if self._cancelled:
            return Finished("cancelled", 0, streamed.completion_tokens)
        if self._timed_out:
            raise self._timeout()
        if exchange.broken is not None:
            raise BackendError(worker_pb2.ERROR_CLASS_BACKEND, f"Triton sent a malformed response: {exchange.broken}")
        if not exchange.complete:
            raise BackendError(worker_pb2.ERROR_CLASS_UNAVAILABLE, "Triton: the connection closed mid-stream")
        if exchange.status != 200:
            # Refused before any response (model unknown or not ready, server stopping): a plain JSON body.
            raise _refused(exchange.status, _error_text(exchange.rest))
        # A model without a finish_reason output (the stock vLLM backend) ends its stream without saying why.
        return Finished("stop", streamed.input_tokens, streamed.completion_tokens)


async def _payloads(exchange: _Exchange) -> AsyncIterator[dict[str, Any]]:
    """Each event's JSON object as it arrives; an ``error`` event (or a failed status) raises."""
    while True:
        await exchange.wait()
        for raw in exchange.take():
            data = _decode(raw)
            if "error" in data or exchange.status != 200:
                raise _refused(exchange.status, str(data.get("error") or ""))
            yield data
        if exchange.closed and not exchange.events:
            return


class _Streamed:
    """What a generation's events said so far: tokens streamed, the prompt's size, whether the final one came."""

    __slots__ = ("alternatives", "completion_tokens", "finished", "input_tokens")

    def __init__(self, alternatives: int | None = None) -> None:
        self.completion_tokens = 0
        self.input_tokens = 0
        self.finished = False
        self.alternatives = alternatives
        """Alternatives per token with its logprob (None: no logprobs asked for)."""

    def events(self, data: dict[str, Any]) -> tuple[Delta | Finished, ...]:
        """The generation's events for one response: a Delta, or the final one's (the one with a finish_reason)."""
        text = str(data.get("text_output") or "")
        tokens = _uint(data, "num_output_tokens")
        self.input_tokens = _uint(data, "num_input_tokens") or self.input_tokens
        logprobs = () if self.alternatives is None else logprobs_of(str(data.get("logprobs") or ""), self.alternatives)
        finish_reason = str(data.get("finish_reason") or "")
        if finish_reason:
            self.finished = True
            cached = _uint(data, "num_cached_tokens")
            events = last_events(finish_reason, self.input_tokens, cached, text, tokens, self.completion_tokens)
            return tuple(dataclasses.replace(e, logprobs=logprobs) if isinstance(e, Delta) else e for e in events)
        self.completion_tokens += tokens
        return (Delta(text, tokens, logprobs),) if text else ()


_STATUS_CLASSES = {
    404: worker_pb2.ERROR_CLASS_MODEL_NOT_FOUND,
    503: worker_pb2.ERROR_CLASS_UNAVAILABLE,
}
"""The class of a refusal whose text says nothing more specific (Triton's HttpCodeFromError)."""


def _refused(status: int, error: str) -> BackendError:
    """Triton's error (an ``error`` event, or a refusal's body), classified by its text, else by the HTTP status."""
    error_class = classify_backend_message(error) if error else worker_pb2.ERROR_CLASS_BACKEND
    if error_class == worker_pb2.ERROR_CLASS_BACKEND:
        error_class = _STATUS_CLASSES.get(status, error_class)
    return BackendError(error_class, f"Triton: {error}" if error else f"Triton: HTTP {status} with no error")


def _error_text(body: bytes) -> str:
    """The ``error`` of a JSON body, or the body itself (cut short) when it is not one."""
    try:
        data = json.loads(body.decode("utf-8", errors="replace"))
    except ValueError:
        return body[:200].decode("utf-8", errors="replace").strip()
    return str(data.get("error") or "") if isinstance(data, dict) else ""


def _decode(raw: bytes) -> dict[str, Any]:
    """One event's JSON object; a broken one fails this generation, never the worker."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        try:  # Triton copies a BYTES output into the JSON as it is: invalid UTF-8 is replaced, as on gRPC
            data = json.loads(raw.decode("utf-8", errors="replace"))
        except ValueError:
            raise BackendError(worker_pb2.ERROR_CLASS_BACKEND, f"Triton sent a malformed event: {exc}") from exc
    if not isinstance(data, dict):
        raise BackendError(worker_pb2.ERROR_CLASS_BACKEND, f"Triton sent a malformed event: {raw[:80]!r}")
    return data


def _uint(data: dict[str, Any], name: str) -> int:
    """A UINT32 output, which Triton writes as a number (or a one-element list); 0 when absent."""
    value = data.get(name, 0)
    if isinstance(value, list):
        value = value[0] if value else 0
    return int(value) if isinstance(value, int | float) else 0
