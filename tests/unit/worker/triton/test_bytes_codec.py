"""Triton's BYTES codec, and what a malformed element does to a generation and to the worker."""

from __future__ import annotations

import json

import grpc
import pytest
from tritonclient.grpc import service_pb2

from tests.support.fakes import FakeBackend
from tests.support.mesh import in_process_mesh, stats
from tokenmesh.v1 import inference_pb2, worker_pb2
from tokenmesh.worker import BackendError, Delta, Finished, GenerationParams
from tokenmesh.worker.triton import MalformedBytes, TritonGeneration, build_request, decode_first, encode_bytes
from tokenmesh.worker.triton._codec import _Outputs

NON_ASCII = "Paris — 巴黎 🇫🇷"


@pytest.mark.parametrize("text", ["Paris", "", NON_ASCII, "a\x00b"])
def test_a_string_survives_the_round_trip(text: str) -> None:
    assert decode_first(encode_bytes(text)) == text


def test_the_length_prefix_counts_utf8_bytes_little_endian() -> None:
    encoded = encode_bytes(NON_ASCII)
    data = NON_ASCII.encode("utf-8")
    assert len(data) > len(NON_ASCII)  # the prefix must count bytes, not characters
    assert encoded == len(data).to_bytes(4, "little") + data
    assert encode_bytes("") == b"\x00\x00\x00\x00"


def test_decode_reads_the_first_element_of_several() -> None:
    assert decode_first(encode_bytes(NON_ASCII) + encode_bytes("second")) == NON_ASCII


@pytest.mark.parametrize("raw", [b"", b"\x05", b"\x00\x00\x00"])
def test_a_prefix_shorter_than_4_bytes_raises(raw: bytes) -> None:
    with pytest.raises(MalformedBytes, match=f"of {len(raw)} bytes is shorter than its 4-byte length prefix"):
        decode_first(raw)


def test_a_prefix_larger_than_the_data_raises_instead_of_returning_a_cut_string() -> None:
    size = len(NON_ASCII.encode("utf-8"))
    cut = encode_bytes(NON_ASCII)[:-3]
    with pytest.raises(MalformedBytes, match=f"says {size} bytes, {size - 3} follow it"):
        decode_first(cut)
    assert issubclass(MalformedBytes, ValueError)


def response(final: bool, **outputs: bytes) -> service_pb2.ModelInferResponse:
    message = service_pb2.ModelInferResponse(model_name="m")
    for name, raw in outputs.items():
        message.outputs.add(name=name, datatype="BYTES" if name in ("text_output", "finish_reason") else "UINT32")
        message.raw_output_contents.append(raw)
    message.parameters["triton_final_response"].bool_param = final
    return message


def uint32(value: int) -> bytes:
    return value.to_bytes(4, "little")


def test_outputs_reads_text_and_counts_and_treats_absent_or_empty_outputs_as_empty() -> None:
    outputs = _Outputs(response(False, text_output=encode_bytes(NON_ASCII), num_output_tokens=uint32(3), empty=b""))
    assert outputs.text("text_output") == NON_ASCII
    assert outputs.uint("num_output_tokens") == 3
    assert outputs.text("finish_reason") == "" and outputs.text("empty") == ""  # no element: no text
    assert not outputs.final
    with pytest.raises(MalformedBytes):
        _Outputs(response(False, text_output=b"\x09\x00\x00\x00abc")).text("text_output")


def test_build_request_encodes_the_vllm_backend_tensors() -> None:
    params = GenerationParams(model="m", prompt=NON_ASCII, max_tokens=7, stop=("\n",), messages=(("user", "hi"),))
    request = build_request(params)
    raw = dict(zip([i.name for i in request.inputs], request.raw_input_contents, strict=True))
    assert decode_first(raw["text_input"]) == NON_ASCII
    assert raw["stream"] == b"\x01"
    assert json.loads(decode_first(raw["sampling_parameters"])) == {"max_tokens": 7, "stop": ["\n"]}
    assert json.loads(decode_first(raw["messages"])) == [{"role": "user", "content": "hi"}]


class FakeCall:
    """A ModelStreamInfer call that answers with the given responses, then ends the stream."""

    def __init__(self, responses: list[service_pb2.ModelInferResponse]) -> None:
        self.reads = [service_pb2.ModelStreamInferResponse(infer_response=r) for r in responses]
        self.written: list[service_pb2.ModelInferRequest] = []
        self.cancelled = False

    async def write(self, request: service_pb2.ModelInferRequest) -> None:
        self.written.append(request)

    async def done_writing(self) -> None:
        pass

    async def read(self) -> object:
        return self.reads.pop(0) if self.reads else grpc.aio.EOF

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeStub:
    def __init__(self, responses: list[service_pb2.ModelInferResponse]) -> None:
        self.responses = responses
        self.calls: list[FakeCall] = []

    def ModelStreamInfer(self, timeout: float | None = None, metadata: object = None) -> FakeCall:  # noqa: N802
        call = FakeCall(list(self.responses))
        self.calls.append(call)
        return call


async def events(stub: FakeStub, prompt: str = "hi") -> list[Delta | Finished]:
    generation = TritonGeneration(stub, GenerationParams(model="m", prompt=prompt))  # type: ignore[arg-type]
    return [event async for event in generation]


async def test_a_generation_streams_non_ascii_deltas_then_finishes() -> None:
    stub = FakeStub(
        [
            response(False, text_output=encode_bytes("Paris — "), num_output_tokens=uint32(2)),
            response(False, text_output=encode_bytes("巴黎 🇫🇷"), num_output_tokens=uint32(3)),
            response(
                True, finish_reason=encode_bytes("length"), num_input_tokens=uint32(4), num_output_tokens=uint32(5)
            ),
        ]
    )
    assert await events(stub) == [Delta("Paris — ", 2), Delta("巴黎 🇫🇷", 3), Finished("length", 4, 5)]


@pytest.mark.parametrize("raw", [b"\x01\x00", b"\xff\x00\x00\x00short"])
async def test_a_malformed_element_fails_the_generation_as_a_backend_error(raw: bytes) -> None:
    stub = FakeStub(
        [
            response(False, text_output=encode_bytes("fine "), num_output_tokens=uint32(1)),
            response(False, text_output=raw, num_output_tokens=uint32(1)),
        ]
    )
    seen: list[Delta | Finished] = []
    with pytest.raises(BackendError) as info:
        async for event in TritonGeneration(stub, GenerationParams(model="m", prompt="hi")):  # type: ignore[arg-type]
            seen.append(event)
    assert seen == [Delta("fine ", 1)]
    assert info.value.error_class == worker_pb2.ERROR_CLASS_BACKEND
    assert "Triton sent a malformed response: BYTES element" in info.value.message
    assert isinstance(info.value.__cause__, MalformedBytes)
    assert stub.calls[0].cancelled  # Triton is told to stop the request


async def test_a_malformed_response_fails_its_generation_and_the_worker_keeps_serving(monkeypatch) -> None:
    malformed = FakeStub([response(False, text_output=b"\x40\x00\x00\x00cut", num_output_tokens=uint32(1))])
    real = FakeBackend.generate

    def generate(self: FakeBackend, params: GenerationParams):
        if params.prompt == "malformed":
            return TritonGeneration(malformed, params)  # type: ignore[arg-type]
        return real(self, params)

    monkeypatch.setattr(FakeBackend, "generate", generate)
    async with in_process_mesh(max_migrations=1) as mesh:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="malformed")):
                pass
        # Both workers tried it and failed the generation with the error (the router's
        # policy picks the caller's code); neither went down or restarted its backend.
        assert "failed on 2 workers" in (info.value.details() or "")
        assert "Triton sent a malformed response: BYTES element" in (info.value.details() or "")
        assert len(malformed.calls) == 2
        for i in (0, 1):
            seen = await stats(mesh, i)
            assert seen.state_reason == "serving" and seen.backend_restarts == 0
