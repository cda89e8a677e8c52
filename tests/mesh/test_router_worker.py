"""Router and worker logic over the in-memory backend (real gRPC servers on 127.0.0.1:0)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from tests.support.mesh import InProcessMesh, assert_exact, collect, in_process_mesh, wait_until
from tokenmesh.router._spares import SPARE
from tokenmesh.v1 import inference_pb2, router_pb2

pytestmark = pytest.mark.usefixtures("mesh_road")  # down the Link and the per-generation road alike


async def test_chunks_have_contiguous_seq_and_a_final_chunk(mesh: InProcessMesh) -> None:
    chunks = await collect(mesh, prompt="hello", max_tokens=5)
    # Tokens the router has not yet read merge into one chunk (a loaded machine), so the count of chunks varies;
    # their seq never skips and the text and token counts add up exactly.
    assert_exact(chunks, 5)
    assert "".join(c.text for c in chunks) == "tok0 tok1 tok2 tok3 tok4 "
    assert all(c.token_count > 0 for c in chunks[:-1])
    assert all(c.finish_reason == inference_pb2.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    final = chunks[-1]
    assert final.finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (3, 5)
    assert len({c.request_id for c in chunks}) == 1 and chunks[0].request_id
    assert all(c.model == "fake" for c in chunks)


async def test_sequential_generations_spread_over_both_workers(mesh: InProcessMesh) -> None:
    for _ in range(8):
        await collect(mesh, prompt="hello", max_tokens=2)
    table = await mesh.operator.GetRoutingTable(router_pb2.GetRoutingTableRequest())
    assert sorted(w.served_total for w in table.workers) == [4, 4]
    assert all(w.in_flight == 0 for w in table.workers)
    # Nothing per stream outlives it: without a caller-chosen id there is nothing to resume.
    await wait_until(lambda: all(not w.servicer.registry.records for w in mesh.workers))


@pytest.mark.parametrize(
    ("fields", "code", "needle"),
    [
        ({}, grpc.StatusCode.INVALID_ARGUMENT, "set prompt, or messages"),
        ({"prompt": "x", "max_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be 1..512"),
        ({"prompt": "x", "max_tokens": 513}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be 1..512"),
        ({"prompt": "x", "temperature": -0.5}, grpc.StatusCode.INVALID_ARGUMENT, "temperature must be >= 0"),
        ({"prompt": "x", "top_p": 1.5}, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        ({"prompt": "x", "model": "nope"}, grpc.StatusCode.NOT_FOUND, "unknown model 'nope'"),
        ({"prompt": "x", "priority": 9}, grpc.StatusCode.INVALID_ARGUMENT, "unknown priority"),
        ({"prompt": "x" * (1024 * 1024 + 1)}, grpc.StatusCode.INVALID_ARGUMENT, "limit is 1048576 bytes"),
        (
            {"messages": [inference_pb2.ChatMessage(role="robot", content="hi")]},
            grpc.StatusCode.INVALID_ARGUMENT,
            "role",
        ),
        (
            {"prompt": "x", "messages": [inference_pb2.ChatMessage(role="user", content="hi")]},
            grpc.StatusCode.INVALID_ARGUMENT,
            "not both",
        ),
        ({"prompt": "fail-invalid"}, grpc.StatusCode.INVALID_ARGUMENT, "context size"),
    ],
)
async def test_bad_input_gets_a_precise_status(mesh: InProcessMesh, fields, code, needle) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(mesh, **fields)
    assert info.value.code() == code
    assert needle in info.value.details()


async def test_bad_input_burst_leaves_other_streams_and_workers_untouched(mesh: InProcessMesh) -> None:
    for b in mesh.backends:
        b.delay = 0.01
    good = asyncio.create_task(collect(mesh, prompt="long", max_tokens=30))
    bad = [collect(mesh, prompt="x", temperature=-1.0) for _ in range(20)]
    bad += [collect(mesh, prompt="fail-invalid") for _ in range(10)]
    results = await asyncio.gather(*bad, return_exceptions=True)
    assert all(isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.INVALID_ARGUMENT for r in results)
    chunks = await good
    assert_exact(chunks, 30)
    table = await mesh.operator.GetRoutingTable(router_pb2.GetRoutingTableRequest())
    assert all(w.weight == 1.0 and w.state == router_pb2.WORKER_STATE_SERVING for w in table.workers)


async def test_live_request_id_is_refused_with_already_exists(mesh: InProcessMesh) -> None:
    for b in mesh.backends:
        b.delay = 0.05
    first = mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="a", max_tokens=20, request_id="dup"))
    await first.read()  # live now
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(mesh, prompt="b", request_id="dup")
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    first.cancel()
    # Once the first one is gone the id can be used again.
    await wait_until(lambda: "dup" not in mesh.router.inference.live.by_id)
    chunks = await collect(mesh, prompt="c", max_tokens=1, request_id="dup")
    assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH


async def test_caller_cancel_reaches_the_backend_and_counts_return_to_zero(mesh: InProcessMesh) -> None:
    for b in mesh.backends:
        b.delay = 0.05
    call = mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="a", max_tokens=500))
    await call.read()
    call.cancel()
    started = [g for b in mesh.backends for g in b.started if g.params.max_tokens == 500]
    assert len(started) == 1
    await asyncio.wait_for(started[0].cancelled.wait(), 2)
    await wait_until(lambda: all(w.servicer.in_flight == 0 for w in mesh.workers))
    await wait_until(lambda: all(e.in_flight == 0 for e in mesh.router.pool.entries.values()))


async def test_cancel_rpc_ends_the_stream_with_cancelled(mesh: InProcessMesh) -> None:
    for b in mesh.backends:
        b.delay = 0.05
    call = mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="a", max_tokens=500, request_id="c1"))
    await call.read()
    response = await mesh.inference.Cancel(inference_pb2.CancelRequest(request_id="c1"))
    assert response.cancelled
    rest = []
    while (chunk := await call.read()) is not grpc.aio.EOF:
        rest.append(chunk)
    assert rest[-1].finish_reason == inference_pb2.FINISH_REASON_CANCELLED
    assert [c.seq for c in rest] == list(range(2, 2 + len(rest)))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await mesh.inference.Cancel(inference_pb2.CancelRequest(request_id="c1"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_worker_failure_before_first_chunk_is_retried_elsewhere() -> None:
    # fail-backend fails on whichever worker gets it, so the retry also fails:
    # the caller gets UNAVAILABLE once both workers were tried (max_migrations=1).
    async with in_process_mesh(max_migrations=1) as mesh:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(mesh, prompt="fail-backend")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "failed on 2 workers" in info.value.details()
        tried = [len([g for g in b.started if g.params.prompt == "fail-backend"]) for b in mesh.backends]
        assert tried == [1, 1]


async def test_backend_failure_does_not_count_caller_errors(mesh: InProcessMesh) -> None:
    with pytest.raises(grpc.aio.AioRpcError):
        await collect(mesh, prompt="fail-invalid")
    # A caller error is not retried on the other worker.
    assert sum(len([g for g in b.started if g.params.prompt == "fail-invalid"]) for b in mesh.backends) == 1


async def test_no_healthy_worker_is_unavailable(mesh: InProcessMesh) -> None:
    for w in mesh.workers:
        w.servicer.serving = False
        await w.host.set_ready(False)
    await wait_until(lambda: not any(e.healthy for e in mesh.router.pool.entries.values()))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(mesh, prompt="x")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_list_models(mesh: InProcessMesh) -> None:
    response = await mesh.inference.ListModels(inference_pb2.ListModelsRequest())
    assert [(m.name, m.max_context, m.is_default, m.workers) for m in response.models] == [("fake", 512, True, 2)]


async def test_deadline_travels_to_the_worker(mesh: InProcessMesh) -> None:
    for b in mesh.backends:
        b.delay = 0.05
    with pytest.raises(grpc.aio.AioRpcError) as info:
        request = inference_pb2.GenerateRequest(prompt="slow", max_tokens=500)
        async for _ in mesh.inference.Generate(request, timeout=0.3):
            pass
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    started = [g for b in mesh.backends for g in b.started if g.params.prompt == "slow"]
    assert len(started) == 1
    assert started[0].params.timeout_s is not None and 0 < started[0].params.timeout_s <= 0.35
    await asyncio.wait_for(started[0].cancelled.wait(), 2)
    await wait_until(lambda: all(w.servicer.in_flight == 0 for w in mesh.workers))


async def test_worker_calls_are_opened_ahead_and_carry_the_callers_deadline() -> None:
    # The spares are the per-generation path's (Worker/Generate); with the link on, no call is opened per generation.
    async with in_process_mesh(worker_link="off") as mesh:
        timeouts: list[float | None] = []
        for backend in mesh.backends:

            def recording(params, original=backend.generate):  # type: ignore[no-untyped-def]
                timeouts.append(params.timeout_s)
                return original(params)

            backend.generate = recording  # type: ignore[method-assign]
        request = inference_pb2.GenerateRequest(prompt="hello", max_tokens=2)
        assert [c.seq async for c in mesh.inference.Generate(request, timeout=30)] == [1, 2, 3]
        # The call to the worker was opened before the caller came (no deadline of its own):
        # the caller's deadline reaches the engine through the start command.
        # The server's remaining time can read a little above the 30 s the client set (30.098 s seen).
        assert timeouts[0] is not None and 25 < timeouts[0] <= 31

        def spares() -> list[Any]:
            return [c for _, link in mesh.router.links.items() if (c := link.held(SPARE)) is not None]

        assert len(spares()) == 1  # for the worker that ran it, opened once its start was sent
        first = spares()[0]
        assert not first.done()
        for _ in range(4):  # spread over both workers
            await collect(mesh, prompt="hello", max_tokens=2)
        assert timeouts[1:] == [None] * 4  # no deadline: none for the engine either
        # That spare carried a later generation and is done; each worker has a new one open.
        assert first.done() and len(spares()) == 2 and not any(c.done() or c is first for c in spares())
