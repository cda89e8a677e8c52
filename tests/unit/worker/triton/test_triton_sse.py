"""TritonSseGeneration against a scripted HTTP server on loopback (no Triton): its request, events, errors, cancels."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tokenmesh.v1 import worker_pb2
from tokenmesh.worker._backend import BackendError, Delta, Finished, GenerationParams
from tokenmesh.worker.triton._sse import TritonSseGeneration

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
HEAD_200 = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nTransfer-Encoding: chunked\r\n\r\n"
HEAD_400 = HEAD_200.replace(b"200 OK", b"400 Bad Request")
END = b"0\r\n\r\n"


def event(**data: Any) -> bytes:
    """One SSE event as Triton writes it, in one HTTP chunk."""
    body = b"data: " + json.dumps(data).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(body), body)


def token(text: str, tokens: int = 1) -> bytes:
    return event(finish_reason="", model_name="m", num_input_tokens=0, num_output_tokens=tokens, text_output=text)


def final(text: str, tokens: int, prompt_tokens: int, finish: str = "length", **extra: Any) -> bytes:
    return event(
        finish_reason=finish, num_input_tokens=prompt_tokens, num_output_tokens=tokens, text_output=text, **extra
    )


class Server:
    """Answers each connection with a script: bytes to write, "wait" for the client to close, "hang" to say nothing."""

    def __init__(self, script: list[Any]) -> None:
        self.script = script
        self.requests: list[bytes] = []
        self.client_closed = asyncio.Event()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(
            next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")).split(b":")[1]
        )
        self.requests.append(head + await reader.readexactly(length))
        try:
            await self._play(reader, writer)
        except (ConnectionError, asyncio.CancelledError):
            pass  # the client closed first, or the test ended
        finally:
            writer.close()

    async def _play(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for step in self.script:
            if step == "hang":
                await reader.read()  # until the client closes
                self.client_closed.set()
                return
            writer.write(step)
            await writer.drain()
            await asyncio.sleep(0.01)  # each step its own read on the client's side


def params(**overrides: Any) -> GenerationParams:
    fields: dict[str, Any] = {
        "model": "m",
        "prompt": "p",
        "request_id": "r",
        "timeout_s": 5.0,
        "max_tokens": 8,
        "trace_context": (("traceparent", TRACEPARENT),),
    }
    return GenerationParams(**(fields | overrides))


async def events(made: TritonSseGeneration) -> list[Delta | Finished]:
    stream: AsyncIterator[Delta | Finished] = made.__aiter__()
    return [item async for item in stream]


async def test_the_request_then_deltas_in_order_then_the_final_responses_text_and_the_end() -> None:
    script = [HEAD_200, token("a"), token("", 0), token("b", 2), final("cd", 5, 7), END]
    async with Server(script) as server:
        made = TritonSseGeneration("127.0.0.1", server.port, params(messages=(("user", "hi"),), seed=3))
        assert await events(made) == [Delta("a", 1), Delta("b", 2), Delta("cd", 2), Finished("length", 7, 5)]
    head, body = server.requests[0].split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /v2/models/m/generate_stream HTTP/1.1"
    assert f"traceparent: {TRACEPARENT}" in lines
    sent = json.loads(body)
    assert sent["id"] == "r" and sent["text_input"] == "p" and sent["stream"] is True
    assert json.loads(sent["sampling_parameters"]) == {"max_tokens": 8, "seed": 3}
    assert json.loads(sent["messages"]) == [{"role": "user", "content": "hi"}]


async def test_events_cut_anywhere_and_several_in_one_read_come_out_whole_and_in_order() -> None:
    stream = b"".join([token(f" t{i}") for i in range(6)]) + final("", 6, 2) + END
    cuts = [HEAD_200[:20], HEAD_200[20:] + stream[:7], stream[7:60], stream[60:61], stream[61:]]
    async with Server(cuts) as server:
        got = await events(TritonSseGeneration("127.0.0.1", server.port, params()))
    assert got == [*(Delta(f" t{i}", 1) for i in range(6)), Finished("length", 2, 6)]


async def test_the_cached_tokens_of_the_final_event_are_the_ends() -> None:
    async with Server([HEAD_200, token("a"), final("", 1, 40, num_cached_tokens=32), END]) as server:
        got = await events(TritonSseGeneration("127.0.0.1", server.port, params()))
    assert got == [Delta("a", 1), Finished("length", 40, 1, cached_prompt_tokens=32)]


async def test_a_response_that_ends_without_a_finish_reason_ends_it_with_stop() -> None:
    async with Server([HEAD_200, token("a"), token("b"), END]) as server:
        got = await events(TritonSseGeneration("127.0.0.1", server.port, params()))
    assert got == [Delta("a", 1), Delta("b", 1), Finished("stop", 0, 2)]


async def test_an_error_event_mid_stream_is_a_backend_error_of_its_class() -> None:
    async with Server([HEAD_200, token("a"), event(error="CUDA out of memory"), END]) as server:
        made = TritonSseGeneration("127.0.0.1", server.port, params())
        stream = made.__aiter__()
        assert await anext(stream) == Delta("a", 1)
        with pytest.raises(BackendError) as raised:
            await anext(stream)
    assert raised.value.error_class == worker_pb2.ERROR_CLASS_OUT_OF_MEMORY
    assert raised.value.message == "Triton: CUDA out of memory"


async def test_a_refused_request_fails_with_tritons_words() -> None:
    refusal = event(error="bad request: Expecting value: line 1 column 1 (char 0)")
    async with Server([HEAD_400, refusal, END]) as server:
        with pytest.raises(BackendError) as raised:
            await events(TritonSseGeneration("127.0.0.1", server.port, params()))
    assert raised.value.error_class == worker_pb2.ERROR_CLASS_BACKEND
    assert raised.value.message == "Triton: bad request: Expecting value: line 1 column 1 (char 0)"


@pytest.mark.parametrize(
    ("status", "body", "error_class", "message"),
    [
        (
            b"404 Not Found",
            b'{"error":"Request for unknown model: \'m\' is not found"}',
            worker_pb2.ERROR_CLASS_MODEL_NOT_FOUND,
            "Triton: Request for unknown model: 'm' is not found",
        ),
        (b"503 Service Unavailable", b'{"error":"Server is stopping"}', worker_pb2.ERROR_CLASS_UNAVAILABLE, None),
        (b"500 Internal Server Error", b"oops", worker_pb2.ERROR_CLASS_BACKEND, "Triton: oops"),
    ],
)
async def test_a_refusal_with_a_plain_body_keeps_tritons_words_and_its_class(
    status: bytes, body: bytes, error_class: int, message: str | None
) -> None:
    head = b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (status, len(body))
    async with Server([head + body]) as server:
        with pytest.raises(BackendError) as raised:
            await events(TritonSseGeneration("127.0.0.1", server.port, params()))
    assert raised.value.error_class == error_class
    assert raised.value.message == (message or f"Triton: {json.loads(body)['error']}")


async def test_a_connection_closed_mid_stream_is_an_unavailable_backend() -> None:
    async with Server([HEAD_200, token("a")]) as server:  # then the server closes, no final chunk
        made = TritonSseGeneration("127.0.0.1", server.port, params())
        with pytest.raises(BackendError) as raised:
            await events(made)
    assert raised.value.error_class == worker_pb2.ERROR_CLASS_UNAVAILABLE
    assert raised.value.message == "Triton: the connection closed mid-stream"


async def test_text_that_is_not_utf8_comes_out_replaced_as_on_grpc() -> None:
    body = b'data: {"finish_reason":"","num_output_tokens":1,"text_output":"a\xe2\x82"}\n\n'
    chunk = b"%x\r\n%s\r\n" % (len(body), body)
    async with Server([HEAD_200, chunk, final("", 1, 2), END]) as server:
        got = await events(TritonSseGeneration("127.0.0.1", server.port, params()))
    assert got == [Delta("a\ufffd", 1), Finished("length", 2, 1)]


@pytest.mark.parametrize("bad", [b"data: {not json\n\n", b'data: ["a list"]\n\n'])
async def test_a_malformed_event_fails_the_generation_as_a_backend_error(bad: bytes) -> None:
    chunk = b"%x\r\n%s\r\n" % (len(bad), bad)
    async with Server([HEAD_200, token("a"), chunk, END]) as server:
        with pytest.raises(BackendError) as raised:
            await events(TritonSseGeneration("127.0.0.1", server.port, params()))
    assert raised.value.error_class == worker_pb2.ERROR_CLASS_BACKEND
    assert raised.value.message.startswith("Triton sent a malformed event: ")


async def test_bytes_that_are_not_http_fail_the_generation_as_a_backend_error() -> None:
    async with Server([b"SSH-2.0-OpenSSH\r\n\r\n"]) as server:
        with pytest.raises(BackendError) as raised:
            await events(TritonSseGeneration("127.0.0.1", server.port, params()))
    assert raised.value.error_class == worker_pb2.ERROR_CLASS_BACKEND
    assert raised.value.message.startswith("Triton sent a malformed response: ")


async def test_cancelled_mid_stream_it_closes_the_connection_and_ends_cancelled_with_the_tokens_so_far() -> None:
    async with Server([HEAD_200, token("a"), token("b", 2), "hang"]) as server:
        made = TritonSseGeneration("127.0.0.1", server.port, params())
        stream = made.__aiter__()
        assert [await anext(stream), await anext(stream)] == [Delta("a", 1), Delta("b", 2)]
        made.cancel()
        assert [item async for item in stream] == [Finished("cancelled", 0, 3)]
        await asyncio.wait_for(server.client_closed.wait(), 5)  # what tells Triton to cancel the request


async def test_cancelled_before_it_starts_it_ends_cancelled_without_a_connection() -> None:
    async with Server([HEAD_200, END]) as server:
        made = TritonSseGeneration("127.0.0.1", server.port, params())
        made.cancel()
        assert await events(made) == [Finished("cancelled", 0, 0)]
    assert server.requests == []


async def test_cancelled_while_the_connect_fails_it_ends_cancelled_not_unreachable() -> None:
    async with Server([]) as server:
        port = server.port
    made = TritonSseGeneration("127.0.0.1", port, params())
    first = asyncio.ensure_future(anext(made.__aiter__()))
    asyncio.get_running_loop().call_soon(made.cancel)  # after the connect started, before it failed
    assert await first == Finished("cancelled", 0, 0)


async def test_nothing_listening_is_an_unavailable_backend() -> None:
    async with Server([]) as server:
        port = server.port
    with pytest.raises(BackendError) as raised:
        await events(TritonSseGeneration("127.0.0.1", port, params()))
    assert raised.value.error_class == worker_pb2.ERROR_CLASS_UNAVAILABLE
    assert raised.value.message.startswith(f"Triton: cannot reach 127.0.0.1:{port}: ")


async def test_no_end_within_the_generations_timeout_is_a_timeout_and_the_connection_closes() -> None:
    async with Server([HEAD_200, token("a"), "hang"]) as server:
        with pytest.raises(BackendError) as raised:
            await events(TritonSseGeneration("127.0.0.1", server.port, params(timeout_s=0.3)))
        await asyncio.wait_for(server.client_closed.wait(), 5)
    assert raised.value.error_class == worker_pb2.ERROR_CLASS_TIMEOUT
    assert raised.value.message == "Triton: no end within the generation's 0.3 s"


async def test_the_deadline_passing_while_the_consumer_is_busy_fails_the_generation_not_the_consumer() -> None:
    async with Server([HEAD_200, token("a"), "hang"]) as server:
        stream = TritonSseGeneration("127.0.0.1", server.port, params(timeout_s=0.3)).__aiter__()
        assert await anext(stream) == Delta("a", 1)
        await asyncio.sleep(0.5)  # the consumer's own await, across the deadline: it must not be cancelled
        with pytest.raises(BackendError) as raised:
            await anext(stream)
        await asyncio.wait_for(server.client_closed.wait(), 5)
    assert raised.value.error_class == worker_pb2.ERROR_CLASS_TIMEOUT
