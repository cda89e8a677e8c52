"""Mid-stream failover: the caller's stream continues exactly on another worker."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from tests.support.fakes import FakeBackend
from tests.support.mesh import InProcessMesh, assert_exact, collect, expected_text, in_process_mesh, wait_until
from tests.support.tcp_proxy import TcpProxy
from tokenmesh.router import Router, RouterConfig
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, router_pb2
from tokenmesh.worker import Worker, WorkerConfig

pytestmark = pytest.mark.usefixtures("mesh_road")  # down the Link and the per-generation road alike


async def test_worker_failing_mid_stream_is_continued_elsewhere(mesh: InProcessMesh) -> None:
    mesh.backends[0].fail_after = 4  # the first pick fails after 4 tokens
    chunks = await collect(mesh, prompt="hello", max_tokens=12, seed=7)
    assert_exact(chunks, 12)
    assert chunks[-1].migrations == 1
    first, second = mesh.backends[0].started[0], mesh.backends[1].started[0]
    assert first.params.max_tokens == 12 and first.params.prompt == "hello"
    # The continuation: prompt plus the delivered text, the rest of max_tokens, the same seed.
    assert second.params.prompt == "hello" + expected_text(4)
    assert (second.params.max_tokens, second.params.seed) == (8, 7)
    table = await mesh.operator.GetRoutingTable(router_pb2.GetRoutingTableRequest())
    failed = next(w for w in table.workers if w.address == mesh.workers[0].host.address)
    assert "avoided by this router" in failed.reason and "illegal memory access" in failed.reason


async def test_chat_is_continued_as_a_prefilled_assistant_message(mesh: InProcessMesh) -> None:
    mesh.backends[0].fail_after = 3
    chunks = await collect(mesh, messages=[inference_pb2.ChatMessage(role="user", content="count")], max_tokens=8)
    assert_exact(chunks, 8)
    continued = mesh.backends[1].started[0].params
    assert continued.messages == (("user", "count"), ("assistant", expected_text(3)))


async def test_a_structured_generation_is_retried_whole_before_output_and_aborted_after(mesh: InProcessMesh) -> None:
    grammar = inference_pb2.StructuredOutput(grammar='root ::= "tok"')
    mesh.backends[0].fail_after = 0  # fails before its first token: retried whole, as any generation
    chunks = await collect(mesh, prompt="x", max_tokens=4, structured_output=grammar)
    assert_exact(chunks, 4)
    assert mesh.backends[1].started[0].params.structured == {"grammar": 'root ::= "tok"'}
    mesh.backends[0].fail_after = mesh.backends[1].fail_after = 2  # whichever it gets fails after 2 tokens
    received: list[inference_pb2.GenerateChunk] = []
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        async for chunk in mesh.inference.Generate(
            inference_pb2.GenerateRequest(prompt="x", max_tokens=6, structured_output=grammar)
        ):
            received.append(chunk)
    assert ended.value.code() == grpc.StatusCode.ABORTED, ended.value.details()
    assert "not continued on another worker" in (ended.value.details() or "")
    # What came is what the first worker produced, never a success: no final chunk, and no second worker's start.
    assert "".join(c.text for c in received) == expected_text(2) and not any(c.finish_reason for c in received)
    assert sum(len(b.started) for b in mesh.backends) == 3


async def test_stalled_worker_is_failed_over_after_the_stall_window() -> None:
    async with in_process_mesh(stall_timeout_s=0.3) as mesh:
        mesh.backends[0].stall_after = 5
        started = time.monotonic()
        chunks = await collect(mesh, prompt="hello", max_tokens=10)
        assert_exact(chunks, 10)
        # One 0.3 s stall window, then 5 more tokens: well under 3 s even on a loaded machine; waiting for
        # the TTFT limit (30 s) or for the worker would take far longer.
        assert time.monotonic() - started < 3
        # The stalled generation was cancelled on its worker.
        assert mesh.backends[0].started[0].cancelled.is_set()


async def test_migration_limit_ends_the_stream_with_unavailable() -> None:
    async with in_process_mesh(max_migrations=0) as mesh:
        mesh.backends[0].fail_after = 2
        mesh.backends[1].fail_after = 2
        call = mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="x", max_tokens=10))
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for chunk in call:
                received.append(chunk)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "failed on 1 workers" in info.value.details()  # max_migrations=0: one attempt
        assert "".join(c.text for c in received) == expected_text(2)


async def test_a_stream_that_moves_forward_between_failures_is_not_stopped_by_the_migration_limit() -> None:
    """--max-migrations bounds moves in a row with nothing delivered between them, not a long stream's moves."""
    async with in_process_mesh(max_migrations=1, stall_timeout_s=0.2) as mesh:
        for backend in mesh.backends:
            backend.fail_after = 3  # every attempt delivers 3 tokens, then its worker fails
        chunks = await collect(mesh, prompt="x", max_tokens=14)
        assert_exact(chunks, 14)
        assert chunks[-1].migrations == 4  # 5 attempts of 3, 3, 3, 3 and 2 tokens: 4 moves past a limit of 1


async def test_every_token_delivered_but_end_lost_finishes_with_length(mesh: InProcessMesh) -> None:
    mesh.backends[0].fail_after = 5  # dies right after its 5th and last token
    chunks = await collect(mesh, prompt="x", max_tokens=5)
    assert_exact(chunks, 5)
    assert mesh.backends[1].started == []  # nothing left to generate elsewhere


async def test_cut_connection_mid_stream_fails_over() -> None:
    """A TCP proxy between router and one worker resets the connection mid-stream."""
    backends = [FakeBackend(delay=0.02), FakeBackend(delay=0.02)]
    workers = [Worker(WorkerConfig(port=0, drain_grace_s=1), backend=b) for b in backends]
    proxy: TcpProxy | None = None
    router: Router | None = None
    try:
        for w in workers:
            await w.start()
        proxy = TcpProxy("127.0.0.1", workers[0].host.port)
        await proxy.start()
        router = Router(RouterConfig(port=0, workers=(proxy.address, workers[1].host.address), drain_grace_s=1))
        await router.start()
        await wait_until(lambda: all(e.healthy and e.models for e in router.pool.entries.values()))
        async with grpc.aio.insecure_channel(router.host.address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            call = stub.Generate(inference_pb2.GenerateRequest(prompt="p", max_tokens=40))
            chunks = [await call.read() for _ in range(5)]
            on_proxy = [g for g in backends[0].started if g.params.max_tokens == 40]
            assert on_proxy, "the stream should start on the proxied worker (first in the pool)"
            proxy.cut()
            while (chunk := await call.read()) is not grpc.aio.EOF:
                chunks.append(chunk)
        assert_exact(chunks, 40)
        assert chunks[-1].migrations == 1
        # The worker behind the cut stops the orphaned generation (its router is gone, nobody can resume it).
        await asyncio.wait_for(on_proxy[0].cancelled.wait(), 5)
    finally:
        if router is not None:
            await router.shutdown()
        if proxy is not None:
            await proxy.stop()
        for w in workers:
            await w.shutdown()


async def test_a_slow_caller_is_not_a_stalled_worker() -> None:
    """While the router waits for its caller, silence from the worker is not a stall."""
    async with in_process_mesh(stall_timeout_s=0.3, backend_settings={"max_context": 4096}) as mesh:
        for backend in mesh.backends:
            backend.delay = 0.001
        # The caller's window is small, so the router soon waits on it, not on the worker.
        options = (("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 4096))
        async with grpc.aio.insecure_channel(mesh.router.host.address, options=options) as channel:
            call = inference_pb2_grpc.InferenceStub(channel).Generate(
                inference_pb2.GenerateRequest(prompt="hello", max_tokens=1500)
            )
            chunks = [await call.read()]
            await asyncio.sleep(1.5)  # five stall windows without reading
            while (chunk := await call.read()) is not grpc.aio.EOF:
                chunks.append(chunk)
        assert_exact(chunks, 1500)
        assert chunks[-1].migrations == 0
        assert sum(len(b.started) for b in mesh.backends) == 1  # never restarted elsewhere
