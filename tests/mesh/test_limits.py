"""Limits that bound what one caller can make the mesh hold: each refused precisely, the mesh untouched."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from tests.support.mesh import InProcessMesh, in_process_mesh, wait_until
from tokenmesh.client import Client
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc
from tokenmesh.validation import MAX_LABEL_VALUE_CHARS, MAX_LABELS, MAX_REQUEST_ID_CHARS, MAX_STOP, MAX_STOP_CHARS

INVALID = grpc.StatusCode.INVALID_ARGUMENT

CASES = [
    ({"labels": {f"k{i}": "v" for i in range(MAX_LABELS + 1)}}, f"{MAX_LABELS + 1} labels; at most {MAX_LABELS}"),
    (
        {"labels": {"tenant": "x" * (MAX_LABEL_VALUE_CHARS + 1)}},
        f"label 'tenant': its value must be at most {MAX_LABEL_VALUE_CHARS} printable characters",
    ),
    ({"labels": {"tenant": "a\nb"}}, "printable characters"),
    ({"labels": {"k" * 65: "v"}}, "label key"),
    ({"stop": ["s"] * (MAX_STOP + 1)}, f"{MAX_STOP + 1} stop sequences; at most {MAX_STOP}"),
    ({"stop": ["x" * (MAX_STOP_CHARS + 1)]}, f"stop[0] must be 1..{MAX_STOP_CHARS} characters"),
    ({"stop": [""]}, "stop[0] must be 1.."),
    ({"request_id": "r" * (MAX_REQUEST_ID_CHARS + 1)}, f"at most {MAX_REQUEST_ID_CHARS} printable"),
]


@pytest.mark.parametrize(("fields", "needle"), CASES)
async def test_fields_past_their_limits_are_invalid_argument(mesh: InProcessMesh, fields: dict, needle: str) -> None:
    request = inference_pb2.GenerateRequest(prompt="p", max_tokens=2, **fields)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        [c async for c in mesh.inference.Generate(request)]
    assert info.value.code() == INVALID and needle in (info.value.details() or ""), info.value.details()
    ok = [c async for c in mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="p", max_tokens=2))]
    assert ok[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH


async def test_a_message_over_8_mib_is_resource_exhausted(mesh: InProcessMesh) -> None:
    huge = inference_pb2.GenerateRequest(prompt="x" * (9 * 1024 * 1024), max_tokens=2)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        [c async for c in mesh.inference.Generate(huge)]
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    ok = [c async for c in mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="p", max_tokens=2))]
    assert ok[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH


async def test_streams_past_the_per_connection_limit_are_refused_and_the_client_retries_them() -> None:
    async with in_process_mesh(max_streams_per_connection=3, backend_settings={"delay": 0.02}) as mesh:
        live = mesh.router.inference.live.by_id
        most = 0

        async def watch() -> None:
            nonlocal most
            while True:
                most = max(most, len(live))
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        request = inference_pb2.GenerateRequest(prompt="p", max_tokens=20)
        # One connection: past 3 open streams the router answers REFUSED_STREAM (UNAVAILABLE, never started),
        # which a raw stub sees and tokenmesh.client retries.
        async with grpc.aio.insecure_channel(mesh.router.host.address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            outcomes = await asyncio.gather(*(_finish(stub.Generate(request)) for _ in range(6)))
        async with Client(mesh.router.host.address) as client:
            finals = await asyncio.gather(*(_last(client.generate(request)) for _ in range(6)))
        watcher.cancel()
        await wait_until(lambda: not live)
    assert set(outcomes) <= {"LENGTH", "UNAVAILABLE"} and "LENGTH" in outcomes
    assert [f.finish_reason for f in finals] == [inference_pb2.FINISH_REASON_LENGTH] * 6  # all served in the end
    assert most <= 3  # never more than the limit at once from one connection


async def _finish(stream: AsyncIterator[inference_pb2.GenerateChunk]) -> str:
    try:
        chunks = [c async for c in stream]
    except grpc.aio.AioRpcError as exc:
        return str(exc.code().name)
    return inference_pb2.FinishReason.Name(chunks[-1].finish_reason).removeprefix("FINISH_REASON_")


async def _last(stream: AsyncIterator[inference_pb2.GenerateChunk]) -> inference_pb2.GenerateChunk:
    return [c async for c in stream][-1]
