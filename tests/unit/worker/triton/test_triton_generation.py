"""TritonGeneration against a scripted ModelStreamInfer call (no Triton): its events, its errors, its cancels."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from tritonclient.grpc import service_pb2

from tokenmesh.v1 import worker_pb2
from tokenmesh.worker._backend import BackendError, Delta, Finished, GenerationParams
from tokenmesh.worker.triton._codec import encode_bytes
from tokenmesh.worker.triton._generation import TritonGeneration


def response(
    text: str = "",
    tokens: int = 0,
    *,
    final: bool = False,
    finish: str = "",
    prompt_tokens: int = 0,
    cached_tokens: int | None = None,
    raw_text: bytes | None = None,
) -> service_pb2.ModelStreamInferResponse:
    """One streamed response of the vLLM backend, its outputs as raw contents."""
    infer = service_pb2.ModelInferResponse()
    outputs = [
        ("text_output", encode_bytes(text) if raw_text is None else raw_text),
        ("num_output_tokens", tokens.to_bytes(4, "little")),
    ]
    if final:
        outputs += [("num_input_tokens", prompt_tokens.to_bytes(4, "little")), ("finish_reason", encode_bytes(finish))]
        infer.parameters["triton_final_response"].bool_param = True
    if cached_tokens is not None:
        outputs.append(("num_cached_tokens", cached_tokens.to_bytes(4, "little")))
    for name, raw in outputs:
        infer.outputs.add(name=name)
        infer.raw_output_contents.append(raw)
    return service_pb2.ModelStreamInferResponse(infer_response=infer)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class Call:
    """A ModelStreamInfer call that answers reads from a script (a response, EOF, or an exception to raise)."""

    def __init__(self, script: list[Any], generation: list[TritonGeneration]) -> None:
        self.script = script
        self.generation = generation
        self.written: list[service_pb2.ModelInferRequest] = []
        self.cancelled = False

    async def write(self, request: service_pb2.ModelInferRequest) -> None:
        self.written.append(request)

    async def done_writing(self) -> None:
        pass

    async def read(self) -> Any:
        step = self.script.pop(0)
        if step == "cancel":  # the worker cancels the generation while this read waits
            self.generation[0].cancel()
            raise rpc_error(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")
        if isinstance(step, BaseException):
            raise step
        return step

    def cancel(self) -> None:
        self.cancelled = True


class Stub:
    def __init__(self, script: list[Any]) -> None:
        self.generation: list[TritonGeneration] = []
        self.call = Call(script, self.generation)
        self.opened: list[dict[str, Any]] = []

    def ModelStreamInfer(self, **kwargs: Any) -> Call:  # noqa: N802 - the stub's method name
        self.opened.append(kwargs)
        return self.call


def generation(script: list[Any]) -> tuple[TritonGeneration, Stub]:
    stub = Stub(script)
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    params = GenerationParams(
        model="m", prompt="p", request_id="r", timeout_s=5.0, trace_context=(("traceparent", traceparent),)
    )
    made = TritonGeneration(stub, params)  # type: ignore[arg-type]
    stub.generation.append(made)
    return made, stub


async def events(made: TritonGeneration) -> list[Delta | Finished]:
    stream: AsyncIterator[Delta | Finished] = made.__aiter__()
    return [event async for event in stream]


async def test_deltas_then_the_final_responses_text_and_the_end_with_the_counts() -> None:
    made, stub = generation(
        [
            response("a", 1),
            response("", 0),
            response("b", 2),
            response("cd", 5, final=True, finish="length", prompt_tokens=7),
            grpc.aio.EOF,
        ]
    )
    assert await events(made) == [Delta("a", 1), Delta("b", 2), Delta("cd", 2), Finished("length", 7, 5)]
    assert stub.opened == [{"timeout": 5.0, "metadata": made._params.trace_context}]
    assert [r.id for r in stub.call.written] == ["r"] and stub.call.cancelled


async def test_a_final_response_without_text_ends_it_with_stop_by_default() -> None:
    made, _ = generation([response("a", 1), response("", 1, final=True, prompt_tokens=3)])
    assert await events(made) == [Delta("a", 1), Finished("stop", 3, 1)]


async def test_the_final_responses_cached_tokens_are_the_ends_and_a_model_without_them_reads_as_none() -> None:
    made, _ = generation([response("a", 1), response("", 1, final=True, prompt_tokens=40, cached_tokens=32)])
    assert await events(made) == [Delta("a", 1), Finished("stop", 40, 1, cached_prompt_tokens=32)]
    made, _ = generation([response("a", 1), response("", 1, final=True, prompt_tokens=40)])
    assert (await events(made))[-1].cached_prompt_tokens == 0  # type: ignore[union-attr]


async def test_an_error_response_is_a_backend_error_of_its_class() -> None:
    failed = service_pb2.ModelStreamInferResponse(error_message="CUDA out of memory")
    made, stub = generation([response("a", 1), failed])
    with pytest.raises(BackendError) as raised:
        await events(made)
    assert raised.value.error_class == worker_pb2.ERROR_CLASS_OUT_OF_MEMORY
    assert raised.value.message == "Triton: CUDA out of memory" and stub.call.cancelled


async def test_a_stream_closed_before_the_final_response_is_a_backend_failure() -> None:
    made, _ = generation([response("a", 1), grpc.aio.EOF])
    with pytest.raises(BackendError) as raised:
        await events(made)
    assert raised.value.error_class == worker_pb2.ERROR_CLASS_BACKEND
    assert raised.value.message == "Triton closed the stream before the final response"


@pytest.mark.parametrize(
    ("code", "error_class"),
    [
        (grpc.StatusCode.UNAVAILABLE, worker_pb2.ERROR_CLASS_UNAVAILABLE),
        (grpc.StatusCode.DEADLINE_EXCEEDED, worker_pb2.ERROR_CLASS_TIMEOUT),
        (grpc.StatusCode.INTERNAL, worker_pb2.ERROR_CLASS_BACKEND),
    ],
)
async def test_a_failed_call_is_a_backend_error_of_its_status(code: grpc.StatusCode, error_class: int) -> None:
    made, _ = generation([response("a", 1), rpc_error(code, "gone")])
    with pytest.raises(BackendError) as raised:
        await events(made)
    assert raised.value.error_class == error_class
    assert raised.value.message == f"Triton: {code.name}: gone"


async def test_a_malformed_response_fails_the_generation_as_a_backend_error() -> None:
    made, _ = generation([response(raw_text=b"\x09\x00\x00\x00abc", tokens=1)])
    with pytest.raises(BackendError) as raised:
        await events(made)
    assert raised.value.error_class == worker_pb2.ERROR_CLASS_BACKEND
    assert raised.value.message.startswith("Triton sent a malformed response: ")


async def test_cancelled_before_it_starts_it_ends_cancelled_without_a_call() -> None:
    made, stub = generation([])
    made.cancel()
    assert await events(made) == [Finished("cancelled", 0, 0)]
    assert stub.opened == []


async def test_cancelled_mid_stream_it_ends_cancelled_with_the_tokens_so_far() -> None:
    made, stub = generation([response("a", 1), response("b", 2), "cancel"])
    assert await events(made) == [Delta("a", 1), Delta("b", 2), Finished("cancelled", 0, 3)]
    assert stub.call.cancelled


async def test_a_channel_closed_under_the_call_is_an_unavailable_backend() -> None:
    made, _ = generation([response("a", 1), asyncio.CancelledError()])
    with pytest.raises(BackendError) as raised:
        await events(made)
    assert raised.value.error_class == worker_pb2.ERROR_CLASS_UNAVAILABLE
    assert raised.value.message == "Triton: the channel closed mid-stream"


async def test_its_own_task_cancelled_the_cancel_goes_through() -> None:
    gate = asyncio.Event()

    class Waiting(Call):
        async def read(self) -> Any:
            gate.set()
            await asyncio.Event().wait()

    made, stub = generation([])
    stub.call = Waiting([], stub.generation)
    task = asyncio.create_task(events(made))
    await gate.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert stub.call.cancelled
