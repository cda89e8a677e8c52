"""A worker over a model with exactly the stock vLLM backend's tensors: usage and endings are the engine's.

tests/vllm_repository/vllm_model declares what Triton's vLLM backend declares
(r25.01) and nothing of tokenmesh's own: no ``messages``, no
``num_cached_tokens``, every additional output behind its ``return_*``
switch, as the vLLM backend sends them. It runs SmolLM2's model code, which
honours those switches, so a worker that did not send them would read usage
0 and every end as ``stop`` here as on a GPU.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton

from tokenmesh.v1 import inference_pb2

from .conftest import MeshHandle, running_mesh

pytestmark = pytest.mark.integration

REPOSITORY = str(Path(__file__).resolve().parents[1] / "vllm_repository")


@pytest.fixture(scope="module")
def vllm_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshHandle]:
    with running_mesh(tmp_path_factory.mktemp("vllm"), workers=1, model_repository=REPOSITORY) as handle:
        yield handle


def generate(handle: MeshHandle, **fields: object) -> list[inference_pb2.GenerateChunk]:
    return list(handle.inference.Generate(inference_pb2.GenerateRequest(model="vllm_model", **fields), timeout=120))


def test_usage_and_the_ending_are_the_engines(vllm_mesh: MeshHandle) -> None:
    # llama.cpp's own count for this prompt is 5 tokens (its usage.prompt_tokens).
    cut = generate(vllm_mesh, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert cut[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert (cut[-1].usage.prompt_tokens, cut[-1].usage.completion_tokens) == (5, 6)
    assert sum(c.token_count for c in cut) == 6
    answered = generate(
        vllm_mesh,
        prompt="Is Paris in France? Answer:",
        max_tokens=20,
        structured_output=inference_pb2.StructuredOutput(choice=inference_pb2.Choice(options=[" yes", " no"])),
    )
    assert "".join(c.text for c in answered) in (" yes", " no")
    assert answered[-1].finish_reason == inference_pb2.FINISH_REASON_STOP
    assert answered[-1].usage.prompt_tokens > 0 and 1 <= answered[-1].usage.completion_tokens < 20


def test_a_chat_is_refused_as_the_callers_error(vllm_mesh: MeshHandle) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        generate(vllm_mesh, messages=[inference_pb2.ChatMessage(role="user", content="hi")])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "takes a prompt only" in (refused.value.details() or "")


def test_the_model_sends_usage_only_to_a_request_that_asks_as_the_vllm_backend_does(vllm_mesh: MeshHandle) -> None:
    """Without the switches the figures do not come: what the worker's own requests would get without them."""
    url = str(vllm_mesh.mesh.workers[0].info["triton_url"])
    responses: list[triton.InferResult] = []

    def inputs(ask: bool) -> list[triton.InferInput]:
        tensors = []
        for name, datatype, value in [
            ("text_input", "BYTES", np.array([b"The capital of France is"], dtype=np.object_)),
            ("stream", "BOOL", np.array([True])),
            ("sampling_parameters", "BYTES", np.array([json.dumps({"max_tokens": 2}).encode()], dtype=np.object_)),
            *([("return_num_input_tokens", "BOOL", np.array([True]))] if ask else []),
        ]:
            tensor = triton.InferInput(name, [1], datatype)
            tensor.set_data_from_numpy(value)
            tensors.append(tensor)
        return tensors

    with triton.InferenceServerClient(url) as client:
        client.start_stream(lambda result, error: responses.append(result if error is None else error))
        client.async_stream_infer("vllm_model", inputs(ask=False), request_id="plain")
        client.async_stream_infer("vllm_model", inputs(ask=True), request_id="asked")
        client.stop_stream()  # waits for both streams to end
    finals = {
        r.get_response().id: r for r in responses if r.get_response().parameters["triton_final_response"].bool_param
    }
    assert finals["plain"].as_numpy("num_input_tokens") is None and finals["plain"].as_numpy("finish_reason") is None
    assert int(finals["asked"].as_numpy("num_input_tokens")[0]) == 5
