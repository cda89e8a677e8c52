"""LoRA adapters on the real path: scripts/make_lora.py's SmolLM2 adapters loaded by llama.cpp in Triton.

Adapters A and B (seeds 0 and 1), asked for as the models ``smollm2:a`` and ``smollm2:b``. One worker (SmolLM2
on 2 shared cores) at a time behind the router and the gateway:

- ``static``: its model loads both adapters with itself. Through gRPC and the openai SDK each adapter answers
  otherwise than the base model at the same seed, and the base model's answer stays its own around them. Its
  answers are the reference for the next worker.
- ``on_demand``: ``max_loras`` 1. A loads with the model, a request for B loads B (a new llama.cpp server) and
  evicts A, and so on. Each answer must be the reference's at the same seed, whichever server it ran on, and the
  loads and evictions are counted in the worker's metrics.
"""

from __future__ import annotations

import concurrent.futures
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.lora import QUESTION, chat_answer, lora_repository, write_adapter
from tokenmesh.v1 import inference_pb2
from tokenmesh.worker.triton import TritonBackend, TritonBackendConfig, TritonProcessConfig

from .conftest import MeshHandle, running_mesh

pytestmark = pytest.mark.integration

SAMPLING = {"temperature": 0.0, "seed": 7, "max_tokens": 16}
MODELS = ("smollm2", "smollm2:a", "smollm2:b")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, demo_adapter: Path) -> dict[str, Path]:
    return {"a": demo_adapter, "b": write_adapter(tmp_path_factory.mktemp("lora-b") / "b.gguf", seed=1)}


@pytest.fixture(scope="module")
def static(tmp_path_factory: pytest.TempPathFactory, adapters: dict[str, Path]) -> Iterator[MeshHandle]:
    """A worker whose model loads both adapters with itself."""
    tmp = tmp_path_factory.mktemp("lora-static")
    repository = lora_repository(tmp, adapters)
    with running_mesh(tmp, workers=1, model_repository=str(repository), gateway_port=0) as handle:
        yield handle


@pytest.fixture(scope="module")
def reference(static: MeshHandle) -> dict[str, str]:
    """Each model's answer with both adapters loaded with the model."""
    return {model: answer(static, model) for model in MODELS}


@pytest.fixture(scope="module")
def on_demand(
    tmp_path_factory: pytest.TempPathFactory, adapters: dict[str, Path], reference: dict[str, str]
) -> Iterator[MeshHandle]:
    """The worker that keeps one adapter loaded, started once the reference is taken (the static one idles)."""
    tmp = tmp_path_factory.mktemp("lora-on-demand")
    repository = lora_repository(tmp, adapters, max_loras=1)
    with running_mesh(tmp, workers=1, model_repository=str(repository), metrics=True, gateway_port=0) as handle:
        yield handle


def answer(mesh: MeshHandle, model: str) -> str:
    """The whole text of one chat generation through the router."""
    return chat_answer(mesh.inference, model, SAMPLING)


def adapter_metrics(mesh: MeshHandle) -> dict[tuple[str, str], float]:
    """The worker's adapter samples: (sample name, adapter) -> value."""
    with urllib.request.urlopen(mesh.mesh.metrics_urls["worker-0"], timeout=5) as response:  # noqa: S310
        text = response.read().decode()
    return {
        (sample.name, sample.labels["adapter"]): sample.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("tokenmesh_worker_adapter_")
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


def loads(mesh: MeshHandle) -> dict[str, tuple[float, float]]:
    """(loads, unloads) by adapter, as the worker last read them from its engine."""
    found = adapter_metrics(mesh)
    return {
        a: (
            found.get(("tokenmesh_worker_adapter_loads_total", a), 0.0),
            found.get(("tokenmesh_worker_adapter_unloads_total", a), 0.0),
        )
        for a in ("a", "b")
    }


def loaded(mesh: MeshHandle) -> set[str]:
    return {a for (name, a), v in adapter_metrics(mesh).items() if name == "tokenmesh_worker_adapter_loaded" and v}


async def test_a_max_loras_that_is_not_a_positive_integer_fails_the_model_naming_the_parameter(
    tmp_path: Path, demo_adapter: Path
) -> None:
    """Run first, before the module's workers start."""
    repository = lora_repository(tmp_path, {"demo": demo_adapter}, max_loras="0")
    process = TritonProcessConfig(work_dir=tmp_path / "triton", model_repository=repository, start_timeout_s=120)
    backend = TritonBackend(TritonBackendConfig(process=process))
    why = (
        "TritonModelException: max_loras: '0' is not a positive integer (the most LoRA adapters loaded at once; "
        "empty = every adapter lora_adapters declares)"
    )
    try:
        # The worker's start error names the model and its own error, not only Triton's last lines.
        with pytest.raises(
            RuntimeError, match=re.escape(f"tritonserver exited during start (model smollm2: Internal: {why}):")
        ):
            await backend.start()
    finally:
        await backend.stop()


def test_the_adapter_is_listed_and_answers_otherwise_than_its_base_at_the_same_seed(static: MeshHandle) -> None:
    listed = static.inference.ListModels(inference_pb2.ListModelsRequest(), timeout=5)
    assert [(m.name, m.base) for m in listed.models] == [
        ("smollm2", ""),
        ("smollm2:a", "smollm2"),
        ("smollm2:b", "smollm2"),
    ]
    base = answer(static, "smollm2")
    adapted = answer(static, "smollm2:a")
    assert "Paris" in base
    assert adapted and adapted != base
    # The adapter ran on the slot the base answer had used: the base answer after it is the base's again
    # (every request names its adapters, scale 0 for none, so llama.cpp drops a slot's KV of another adapter).
    assert answer(static, "smollm2") == base
    assert answer(static, "smollm2:a") == adapted


def test_an_unknown_adapter_is_not_found_naming_it(static: MeshHandle) -> None:
    with pytest.raises(grpc.RpcError) as unknown:
        answer(static, "smollm2:nope")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    assert unknown.value.details() == (  # type: ignore[attr-defined]
        "unknown adapter 'nope' of model 'smollm2'; its adapters: smollm2:a, smollm2:b"
    )


def test_the_openai_sdk_gets_the_adapters_answer_through_the_gateway(static: MeshHandle) -> None:
    assert static.mesh.gateway is not None
    client = openai.OpenAI(base_url=str(static.mesh.gateway.info["url"]), api_key="x", max_retries=0)
    cards = {m.id: m.model_extra for m in client.models.list().data}
    assert cards["smollm2:a"]["parent"] == "smollm2" and "parent" not in cards["smollm2"]

    def chat(model: str) -> str:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": QUESTION}], stream=True, **SAMPLING
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    adapted, base = chat("smollm2:a"), chat("smollm2")
    assert adapted != base
    assert adapted == answer(static, "smollm2:a") and base == answer(static, "smollm2")
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="smollm2:nope", messages=[{"role": "user", "content": QUESTION}])
    assert unknown.value.code == "model_not_found" and "'nope'" in unknown.value.message


def test_a_b_a_in_turn_each_answer_as_loaded_with_the_model_and_each_swap_is_counted(
    on_demand: MeshHandle, reference: dict[str, str]
) -> None:
    assert reference["smollm2:a"] != reference["smollm2"] != reference["smollm2:b"] != reference["smollm2:a"]
    listed = on_demand.inference.ListModels(inference_pb2.ListModelsRequest(), timeout=5)
    assert [(m.name, m.base, m.not_loaded) for m in listed.models] == [
        ("smollm2", "", False),
        ("smollm2:a", "smollm2", False),
        ("smollm2:b", "smollm2", True),  # declared, not loaded: the first of max_loras 1 (a) loaded with the model
    ]
    assert loaded(on_demand) == {"a"} and loads(on_demand) == {"a": (1, 0), "b": (0, 0)}
    for model in ("smollm2:a", "smollm2:b", "smollm2:a", "smollm2"):
        assert answer(on_demand, model) == reference[model], model
    wait_for(lambda: loads(on_demand) == {"a": (2, 1), "b": (1, 1)})  # the worker reads its engine's counts each second
    assert loaded(on_demand) == {"a"}


def test_concurrent_requests_for_both_adapters_each_get_their_own_answer(
    on_demand: MeshHandle, reference: dict[str, str]
) -> None:
    models = [MODELS[i % 3] for i in range(9)]
    with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
        texts = list(pool.map(lambda m: answer(on_demand, m), models))
    assert texts == [reference[m] for m in models]

    def one_loaded() -> bool:
        # Every load but the one with the model evicted the other adapter: one loaded at the end.
        counts = loads(on_demand)
        return sum(n - u for n, u in counts.values()) == 1 and len(loaded(on_demand)) == 1

    wait_for(one_loaded)  # the worker reads its engine's counts each second (a scrape may fall inside a swap)
    assert loads(on_demand)["b"][0] >= 2  # a was loaded before: b's requests loaded it again


def test_the_openai_sdk_gets_the_answer_of_an_adapter_loaded_for_it(
    on_demand: MeshHandle, reference: dict[str, str]
) -> None:
    assert on_demand.mesh.gateway is not None
    client = openai.OpenAI(base_url=str(on_demand.mesh.gateway.info["url"]), api_key="x", max_retries=0)
    for model in ("smollm2:b", "smollm2:a"):  # whichever is loaded now, one of them needs a load
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": QUESTION}], **SAMPLING
        )
        assert reply.choices[0].message.content == reference[model]


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)
