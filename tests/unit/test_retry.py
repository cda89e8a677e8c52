"""The one retry policy: transient codes only, full jitter, warnings that name the address."""

from __future__ import annotations

import logging
import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenmesh.errors import ResourceExhausted
from tokenmesh.retry import Backoff, Reconnect, StreamEnded, is_transient

FAST = Backoff(initial_s=0.01, max_s=0.02, warn_after=3)


def _error(code: grpc.StatusCode, trailers: tuple[tuple[str, str | bytes], ...] = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details="x")


def _hint(seconds: float) -> tuple[tuple[str, str | bytes], ...]:
    """The trailers of a refusal with a retry hint, as the mesh sends them (RetryInfo in the status details)."""
    return ResourceExhausted("x", retry_delay=seconds).trailers()


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_which_failures_are_transient() -> None:
    assert is_transient(_error(grpc.StatusCode.UNAVAILABLE))
    assert is_transient(_error(grpc.StatusCode.RESOURCE_EXHAUSTED, _hint(0.02)))
    assert is_transient(TimeoutError())
    assert is_transient(StreamEnded("health stream ended"))
    for code in (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    ):
        assert not is_transient(_error(code)), code
    assert not is_transient(KeyError("a bug"))


def test_the_hint_is_read_from_the_status_details_not_from_a_trailer_of_text() -> None:
    # The plain retry-after-ms trailer is still sent for older callers, but nothing of ours reads it.
    assert not is_transient(_error(grpc.StatusCode.RESOURCE_EXHAUSTED, (("retry-after-ms", "20"),)))
    assert ("retry-after-ms", "20") in _hint(0.02)


async def test_transient_failures_are_retried_until_success() -> None:
    calls = []

    async def attempt() -> str:
        calls.append(time.monotonic())
        if len(calls) < 4:
            raise _error(grpc.StatusCode.UNAVAILABLE)
        return "ok"

    assert await Reconnect("test call", "peer:1", FAST).run(attempt) == "ok"
    assert len(calls) == 4


async def test_a_permanent_code_from_a_real_server_fails_at_once_and_loudly(caplog: pytest.LogCaptureFixture) -> None:
    # A server with no services answers every method UNIMPLEMENTED: the address is some other service.
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    calls = 0
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def attempt() -> health_pb2.HealthCheckResponse:
                nonlocal calls
                calls += 1
                return await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)

            with caplog.at_level(logging.ERROR), pytest.raises(grpc.aio.AioRpcError) as raised:
                await Reconnect("health check", f"127.0.0.1:{port}", FAST).run(attempt)
    finally:
        await server.stop(0)
    assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert calls == 1
    assert any(
        f"127.0.0.1:{port}" in r.message and "UNIMPLEMENTED" in r.message
        for r in caplog.records
        if r.levelno == logging.ERROR
    )


async def test_repeated_unavailable_warns_naming_the_address_then_gives_up_at_the_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    address = _closed_port()
    calls = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        async def attempt() -> health_pb2.HealthCheckResponse:
            nonlocal calls
            calls += 1
            return await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)

        started = time.monotonic()
        with caplog.at_level(logging.WARNING), pytest.raises(grpc.aio.AioRpcError) as raised:
            await Reconnect(
                "health check", address, Backoff(initial_s=0.01, max_s=0.05, deadline_s=1.0, warn_after=3)
            ).run(attempt)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    # Bounded by the deadline (1 s) plus one attempt and one wait; generous for a loaded 2-core machine.
    assert time.monotonic() - started < 5
    assert calls >= 3
    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and all(address in w for w in warnings)
    assert "failed 3 times in a row" in warnings[0]


async def test_a_retry_hint_is_honoured_and_connected_starts_the_count_afresh() -> None:
    reconnect = Reconnect("stream", "peer:1", Backoff(initial_s=0.001, max_s=1.0, warn_after=100))
    calls: list[float] = []

    async def attempt() -> None:
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise _error(grpc.StatusCode.RESOURCE_EXHAUSTED, _hint(0.2))
        if len(calls) == 2:
            raise _error(grpc.StatusCode.UNAVAILABLE)
        if len(calls) == 3:
            reconnect.connected()  # the stream opened, then broke
            raise StreamEnded("ended")

    await reconnect.run(attempt)
    assert len(calls) == 4
    assert calls[1] - calls[0] >= 0.2  # the server's hint, not the 1 ms backoff
    assert reconnect.failures == 1  # counted afresh after connected()


async def test_a_hint_past_the_deadline_ends_the_retries_at_once_with_the_refusal() -> None:
    """A quota's "retry in 50 s" under a 10 s deadline: waiting could not succeed in time, so no wait at all."""
    calls: list[float] = []

    async def attempt() -> None:
        calls.append(time.monotonic())
        raise _error(grpc.StatusCode.RESOURCE_EXHAUSTED, _hint(50 if len(calls) > 1 else 0.05))

    reconnect = Reconnect("call", "peer:1", Backoff(initial_s=0.001, max_s=0.01, deadline_s=10), loud=False)
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await reconnect.run(attempt)
    assert len(calls) == 2  # the short hint was waited for and retried; the long one was not
    assert time.monotonic() - started < 1
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    step = Reconnect("call", "peer:1", Backoff(deadline_s=10))
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError):
        await step.failed(_error(grpc.StatusCode.RESOURCE_EXHAUSTED, _hint(50)))
    assert time.monotonic() - started < 1
    await step.failed(_error(grpc.StatusCode.RESOURCE_EXHAUSTED, _hint(0.01)))  # within it: waited, not raised


async def test_a_write_after_the_peer_ended_the_stream_raises_its_status() -> None:
    """grpc raises a bare InvalidStateError there; the policy needs the status to decide."""
    from tokenmesh.retry import write

    async def ends_at_once(request_iterator, context):  # type: ignore[no-untyped-def]
        await context.abort(grpc.StatusCode.UNAVAILABLE, "worker going away")

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "test.Echo", {"Talk": grpc.stream_stream_rpc_method_handler(ends_at_once)}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream("/test.Echo/Talk")()
            with pytest.raises(grpc.aio.AioRpcError):
                await call.read()  # the call has ended
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await write(call, b"ping")
    finally:
        await server.stop(0)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert is_transient(raised.value)
