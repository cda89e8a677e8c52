"""grpc.health.v1 as the protocol says, on a real server through the generated stub: unknown names."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenmesh.health import NOT_SERVING, SERVICE_UNKNOWN, SERVING, HealthServicer


@contextlib.asynccontextmanager
async def _served(servicer: HealthServicer) -> AsyncIterator[tuple[grpc.aio.Server, health_pb2_grpc.HealthStub]]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield server, health_pb2_grpc.HealthStub(channel)
    finally:
        await server.stop(0)


def _watch(stub: health_pb2_grpc.HealthStub, name: str, **kwargs: float) -> grpc.aio.UnaryStreamCall:
    return stub.Watch(health_pb2.HealthCheckRequest(service=name), **kwargs)


async def _no_message_within(call: grpc.aio.UnaryStreamCall, seconds: float) -> asyncio.Task[object]:
    """Start a read and check it is still waiting after ``seconds`` (cancelling a read would cancel the call)."""
    read = asyncio.ensure_future(call.read())
    done, _ = await asyncio.wait({read}, timeout=seconds)
    assert not done, f"got {read.result()!r}"
    assert not call.done()
    return read


async def test_check_of_an_unknown_name_is_not_found_and_names_the_known_ones() -> None:
    async with _served(HealthServicer(["tokenmesh.v1.Inference"])) as (_, stub):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=2)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'nope'" in (refused.value.details() or "")
    assert "'tokenmesh.v1.Inference'" in (refused.value.details() or "")


async def test_watch_of_an_unknown_name_streams_service_unknown_stays_open_then_sends_the_real_status() -> None:
    servicer = HealthServicer([])
    async with _served(servicer) as (_, stub):
        call = _watch(stub, "tokenmesh.v1.Later", timeout=10)
        assert (await call.read()).status == SERVICE_UNKNOWN
        pending = await _no_message_within(call, 0.3)  # open, and nothing more while the name is unknown
        await servicer.set("tokenmesh.v1.Later", NOT_SERVING)  # the name appears: its real status follows
        assert (await asyncio.wait_for(pending, 5)).status == NOT_SERVING
        await servicer.set("tokenmesh.v1.Later", SERVING)
        assert (await asyncio.wait_for(call.read(), 5)).status == SERVING
        assert (
            await stub.Check(health_pb2.HealthCheckRequest(service="tokenmesh.v1.Later"), timeout=2)
        ).status == SERVING
        call.cancel()
    assert call.cancelled()


async def test_a_cancelled_watch_of_an_unknown_name_ends_on_the_server_too() -> None:
    servicer = HealthServicer([])
    known = len(servicer._conditions)
    async with _served(servicer) as (server, stub):
        calls = [_watch(stub, name) for name in ("nope", "x" * 1000, "tokenmesh.v1.Nothing")]
        assert [(await call.read()).status for call in calls] == [SERVICE_UNKNOWN] * 3
        for call in calls:
            call.cancel()
        assert [await call.code() for call in calls] == [grpc.StatusCode.CANCELLED] * 3
        # A handler still waiting would hold the server's stop for the whole grace.
        started = time.monotonic()
        await server.stop(5)
        assert time.monotonic() - started < 2
    assert len(servicer._conditions) == known  # made-up names left nothing behind


async def test_a_watch_of_an_unknown_name_ends_at_its_deadline() -> None:
    async with _served(HealthServicer([])) as (_, stub):
        call = _watch(stub, "nope", timeout=0.5)
        assert (await call.read()).status == SERVICE_UNKNOWN
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await call.read()
    assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_watch_of_a_known_name_sends_its_status_now_and_each_change() -> None:
    servicer = HealthServicer(["tokenmesh.v1.Inference"])
    async with _served(servicer) as (_, stub):
        call = _watch(stub, "tokenmesh.v1.Inference", timeout=10)
        assert (await call.read()).status == NOT_SERVING
        await servicer.set("tokenmesh.v1.Inference", SERVING)
        assert (await asyncio.wait_for(call.read(), 5)).status == SERVING
        pending = await _no_message_within(call, 0.2)  # nothing changed: nothing sent
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
