"""What a worker's status becomes for the caller: its own errors pass through, the worker's failures fail over."""

from __future__ import annotations

import grpc
import pytest

from tests.support.mesh import InProcessMesh
from tokenmesh.v1 import inference_pb2, router_pb2

pytestmark = pytest.mark.usefixtures("mesh_road")  # down the Link and the per-generation road alike


async def collect(mesh: InProcessMesh, **fields: object) -> list[inference_pb2.GenerateChunk]:
    return [c async for c in mesh.inference.Generate(inference_pb2.GenerateRequest(**fields), timeout=10)]


async def test_a_workers_not_found_reaches_the_caller_as_not_found(mesh: InProcessMesh) -> None:
    # The router's view says both workers serve "ghost" (e.g. it was unloaded since their Describe);
    # the worker it picks answers NOT_FOUND.
    for entry in mesh.router.pool.entries.values():
        entry.models["ghost"] = inference_pb2.ModelInfo(name="ghost", max_context=512)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(mesh, prompt="x", model="ghost", max_tokens=2)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "model 'ghost' is not served here; served: fake" in (info.value.details() or "")
    # A caller error: the worker is not avoided, the request not tried on the other one.
    table = await mesh.operator.GetRoutingTable(router_pb2.GetRoutingTableRequest())
    assert not any("avoided" in w.reason for w in table.workers)
    chunks = await collect(mesh, prompt="x", max_tokens=2)
    assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
