"""LoRA adapters in the mesh: listed with their base, routed only to the workers that loaded them, unknown ones refused.

Two workers over the fake engine; worker 0 loaded adapters ``demo`` and ``terse`` of model ``fake``, worker 1 none.
"""

from __future__ import annotations

import asyncio

import grpc
import openai
import pytest

from tests.support.gateway_helpers import gateway_over
from tests.support.mesh import InProcessMesh, assert_exact, collect, in_process_mesh
from tokenmesh.v1 import inference_pb2, worker_pb2, worker_pb2_grpc

ADAPTERS = ({"adapters": ("demo", "terse")}, {})
"""Worker 0 loaded two adapters of the fake model; worker 1 none."""


def adapters_run(mesh: InProcessMesh, i: int) -> list[str]:
    """The adapter of every generation worker i's engine ran ('' = the model itself), in start order."""
    return [g.params.adapter for g in mesh.backends[i].started]


async def test_list_models_lists_each_adapter_with_its_base_and_the_workers_that_loaded_it() -> None:
    async with in_process_mesh(per_backend=ADAPTERS) as mesh:
        listed = await mesh.inference.ListModels(inference_pb2.ListModelsRequest(), timeout=5)
        assert [(m.name, m.base, m.workers, m.is_default) for m in listed.models] == [
            ("fake", "", 2, True),
            ("fake:demo", "fake", 1, False),
            ("fake:terse", "fake", 1, False),
        ]
        async with gateway_over(mesh) as gateway:
            client = openai.AsyncOpenAI(base_url=gateway.url, api_key="x", max_retries=0)
            cards = {m.id: m.model_extra for m in (await client.models.list()).data}
            assert cards == {
                "fake": {"max_model_len": 512},
                "fake:demo": {"max_model_len": 512, "parent": "fake"},
                "fake:terse": {"max_model_len": 512, "parent": "fake"},
            }
            one = await client.models.retrieve("fake:terse")
            assert one.id == "fake:terse" and one.model_extra == {"max_model_len": 512, "parent": "fake"}


async def test_adapter_requests_go_only_to_the_worker_that_loaded_it_and_wait_there_for_room() -> None:
    """24 adapter and 24 base streams at once: every adapter one runs on worker 0 (8 slots' worth queue there)."""
    async with in_process_mesh(per_backend=ADAPTERS, backend_settings={"delay": 0.005}) as mesh:
        for worker in mesh.workers:
            worker.servicer.metrics.enabled = True
        requests = [dict(model="fake:demo", prompt=f"a{i}", max_tokens=12) for i in range(20)]
        requests += [dict(model="fake:terse", prompt=f"t{i}", max_tokens=12) for i in range(4)]
        requests += [dict(model="fake", prompt=f"b{i}", max_tokens=12) for i in range(24)]
        results = await asyncio.gather(*(collect(mesh, **r) for r in requests))
        for chunks in results:
            assert_exact(chunks, 12)  # the fake engine's text is the same with an adapter: nothing lost or mixed
        assert sorted(a for a in adapters_run(mesh, 0) if a) == ["demo"] * 20 + ["terse"] * 4
        on_one = adapters_run(mesh, 1)
        assert on_one and set(on_one) == {""}  # base streams used worker 1's room; no adapter stream went there
        # Each generation ran with the adapter it asked for (the worker maps the name to its engine's adapter).
        for generation in mesh.backends[0].started:
            wanted = generation.params.prompt[0]
            assert generation.params.adapter == {"a": "demo", "t": "terse", "b": ""}[wanted]
            assert generation.params.model == "fake"
        sample = mesh.workers[0].servicer.metrics.registry.get_sample_value
        assert sample("tokenmesh_worker_adapter_generations_total", {"model": "fake", "adapter": "demo"}) == 20
        assert sample("tokenmesh_worker_adapter_generations_total", {"model": "fake", "adapter": "terse"}) == 4
        assert sample("tokenmesh_worker_adapter_loaded", {"model": "fake", "adapter": "demo"}) == 1
        assert sample("tokenmesh_worker_adapter_loaded", {"model": "fake", "adapter": "terse"}) == 1
        other = mesh.workers[1].servicer.metrics.registry.get_sample_value
        assert other("tokenmesh_worker_adapter_loaded", {"model": "fake", "adapter": "demo"}) is None


async def test_an_unknown_adapter_is_not_found_naming_it_on_grpc_and_404_model_not_found_on_http() -> None:
    async with in_process_mesh(per_backend=ADAPTERS) as mesh:
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await collect(mesh, model="fake:nope", prompt="hi", max_tokens=3)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        assert unknown.value.details() == (
            "unknown adapter 'nope' of model 'fake'; its adapters: fake:demo, fake:terse"
        )
        with pytest.raises(grpc.aio.AioRpcError) as other_base:
            await collect(mesh, model="other:demo", prompt="hi", max_tokens=3)
        assert other_base.value.code() == grpc.StatusCode.NOT_FOUND
        assert "unknown model 'other:demo'" in (other_base.value.details() or "")
        async with gateway_over(mesh) as gateway:
            client = openai.AsyncOpenAI(base_url=gateway.url, api_key="x", max_retries=0)
            with pytest.raises(openai.NotFoundError) as http:
                await client.chat.completions.create(
                    model="fake:nope", messages=[{"role": "user", "content": "hi"}], max_tokens=3
                )
            assert http.value.status_code == 404 and http.value.code == "model_not_found"
            assert "'nope'" in http.value.message
            with pytest.raises(openai.NotFoundError) as card:
                await client.models.retrieve("fake:nope")
            assert card.value.code == "model_not_found"
        assert not mesh.backends[0].started and not mesh.backends[1].started


async def test_a_worker_asked_for_an_adapter_it_did_not_load_refuses_it_as_not_served() -> None:
    async with in_process_mesh(per_backend=ADAPTERS) as mesh:
        async with grpc.aio.insecure_channel(mesh.workers[1].host.address) as channel:
            call = worker_pb2_grpc.WorkerStub(channel).Generate()
            start = inference_pb2.GenerateRequest(model="fake:demo", prompt="hi", max_tokens=3, request_id="r1")
            await call.write(worker_pb2.WorkerCommand(start=start))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call.read()
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        assert refused.value.details() == "model 'fake:demo' is not served here; served: fake"
        assert not mesh.backends[1].started
