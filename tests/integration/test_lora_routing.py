"""Two real SmolLM2 workers, the adapter loaded on one: its requests go there, the base model's to either.

Each worker is started on its own (as two pods with different model repositories would be), the router in front
names both. The router learns from each worker's Describe which models it serves; an adapter is one of them.
"""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import grpc
import pytest

from tests.support.dns_server import free_port_on
from tests.support.lora import lora_repository
from tokenmesh.mesh import Mesh, MeshConfig
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, router_pb2, router_pb2_grpc

from .conftest import left_behind, mesh_pids

pytestmark = pytest.mark.integration

HOST = "127.0.0.1"
ADAPTER_REQUESTS = 6


def served(channel: grpc.Channel) -> dict[str, int]:
    """Generations each worker completed for this router, by address."""
    table = router_pb2_grpc.RouterStub(channel).GetRoutingTable(router_pb2.GetRoutingTableRequest(), timeout=5)
    return {w.address: w.served_total for w in table.workers}


def wait_serving(channel: grpc.Channel, count: int, timeout_s: float) -> None:
    """Every worker SERVING on the router's own health view (no prober here)."""
    deadline = time.monotonic() + timeout_s
    while True:
        table = router_pb2_grpc.RouterStub(channel).GetRoutingTable(router_pb2.GetRoutingTableRequest(), timeout=5)
        if sum(w.state == router_pb2.WORKER_STATE_SERVING for w in table.workers) == count:
            return
        assert time.monotonic() < deadline, f"workers not all SERVING: {table}"
        time.sleep(0.1)


def generate(channel: grpc.Channel, model: str, i: int) -> str:
    request = inference_pb2.GenerateRequest(model=model, prompt=f"Count to {i + 3}:", max_tokens=4, seed=i)
    chunks = list(inference_pb2_grpc.InferenceStub(channel).Generate(request, timeout=180))
    assert chunks[-1].finish_reason in (inference_pb2.FINISH_REASON_STOP, inference_pb2.FINISH_REASON_LENGTH)
    return "".join(c.text for c in chunks)


def test_an_adapters_requests_go_to_the_worker_that_loaded_it(tmp_path: Path, demo_adapter: Path) -> None:
    with_adapter = lora_repository(tmp_path / "a", {"demo": demo_adapter})
    without = lora_repository(tmp_path / "b", {})
    addresses = [f"{HOST}:{free_port_on(HOST)}" for _ in range(2)]
    mesh = Mesh(MeshConfig(port=0, log_dir=str(tmp_path / "logs")))
    pids: list[int] = []
    try:
        for i, repository in enumerate((with_adapter, without)):
            port = addresses[i].rsplit(":", 1)[1]
            mesh.workers.append(
                mesh.spawn(
                    f"worker-{i}",
                    "worker",
                    *("--host", HOST, "--port", port, "--work-dir", str(tmp_path / f"worker-{i}")),
                    *("--model-repository", str(repository)),
                )
            )
        mesh.router = mesh.spawn("router", "router", "--host", HOST, "--port", "0", "--workers", ",".join(addresses))
        mesh.wait_ready([*mesh.workers, mesh.router])
        pids = mesh_pids(mesh)
        with grpc.insecure_channel(mesh.router.address) as channel:
            wait_serving(channel, 2, timeout_s=120)
            listed = inference_pb2_grpc.InferenceStub(channel).ListModels(inference_pb2.ListModelsRequest(), timeout=5)
            assert sorted(m.name for m in listed.models) == ["smollm2", "smollm2:demo"]
            before = served(channel)
            with concurrent.futures.ThreadPoolExecutor(ADAPTER_REQUESTS) as pool:
                texts = list(pool.map(lambda i: generate(channel, "smollm2:demo", i), range(ADAPTER_REQUESTS)))
            after = served(channel)
            assert all(texts)
            assert after[addresses[0]] - before[addresses[0]] == ADAPTER_REQUESTS  # all on the adapter's worker
            assert after[addresses[1]] == before[addresses[1]]
            base = generate(channel, "smollm2", 0)  # the base model is still served (by either worker)
            assert base
    finally:
        pids += [pid for pid in mesh_pids(mesh) if pid not in pids]
        mesh.stop()
    assert not left_behind(pids)
