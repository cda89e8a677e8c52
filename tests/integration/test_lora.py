"""A LoRA adapter on the real path: scripts/make_lora.py's SmolLM2 adapter loaded by llama.cpp in Triton.

One worker (SmolLM2 on 2 shared cores) whose model declares the adapter ``demo``; the router and the gateway in
front. Asked for as the model ``smollm2:demo``, through gRPC and through the openai SDK, it answers otherwise
than the base model at the same seed, and the base model's answer stays its own around it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from tests.support.lora import QUESTION, chat_answer, lora_repository
from tokenmesh.v1 import inference_pb2

from .conftest import MeshHandle, running_mesh

pytestmark = pytest.mark.integration

SAMPLING = {"temperature": 0.0, "seed": 7, "max_tokens": 24}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, demo_adapter: Path) -> Iterator[MeshHandle]:
    tmp = tmp_path_factory.mktemp("lora-mesh")
    repository = lora_repository(tmp, {"demo": demo_adapter})
    with running_mesh(tmp, workers=1, model_repository=str(repository), gateway_port=0) as handle:
        yield handle


def answer(mesh: MeshHandle, model: str) -> str:
    """The whole text of one chat generation through the router."""
    return chat_answer(mesh.inference, model, SAMPLING)


def test_the_adapter_is_listed_and_answers_otherwise_than_its_base_at_the_same_seed(mesh: MeshHandle) -> None:
    listed = mesh.inference.ListModels(inference_pb2.ListModelsRequest(), timeout=5)
    assert [(m.name, m.base) for m in listed.models] == [("smollm2", ""), ("smollm2:demo", "smollm2")]
    base = answer(mesh, "smollm2")
    adapted = answer(mesh, "smollm2:demo")
    assert "Paris" in base
    assert adapted and adapted != base
    # The adapter ran on the slot the base answer had used: the base answer after it is the base's again
    # (every request names its adapters, scale 0 for none, so llama.cpp drops a slot's KV of another adapter).
    assert answer(mesh, "smollm2") == base
    assert answer(mesh, "smollm2:demo") == adapted


def test_an_unknown_adapter_is_not_found_naming_it(mesh: MeshHandle) -> None:
    with pytest.raises(grpc.RpcError) as unknown:
        answer(mesh, "smollm2:nope")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    assert unknown.value.details() == (  # type: ignore[attr-defined]
        "unknown adapter 'nope' of model 'smollm2'; its adapters: smollm2:demo"
    )


def test_the_openai_sdk_gets_the_adapters_answer_through_the_gateway(mesh: MeshHandle) -> None:
    assert mesh.mesh.gateway is not None
    client = openai.OpenAI(base_url=str(mesh.mesh.gateway.info["url"]), api_key="x", max_retries=0)
    cards = {m.id: m.model_extra for m in client.models.list().data}
    assert cards["smollm2:demo"]["parent"] == "smollm2" and "parent" not in cards["smollm2"]

    def chat(model: str) -> str:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": QUESTION}], stream=True, **SAMPLING
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    adapted, base = chat("smollm2:demo"), chat("smollm2")
    assert adapted != base
    assert adapted == answer(mesh, "smollm2:demo") and base == answer(mesh, "smollm2")
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="smollm2:nope", messages=[{"role": "user", "content": QUESTION}])
    assert unknown.value.code == "model_not_found" and "'nope'" in unknown.value.message
