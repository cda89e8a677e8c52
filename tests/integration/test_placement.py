"""Placement and limits with the services started all at once, as Kubernetes does (synthetic model, real Triton)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from tests.support.dns_server import free_port_on
from tokenmesh.mesh import Mesh, MeshConfig
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, router_pb2, router_pb2_grpc
from tokenmesh.worker.triton import SHIPPED_REPOSITORIES

from .conftest import left_behind, mesh_pids, wait_all_serving

pytestmark = pytest.mark.integration

WORKERS = 3
CALLERS = 16
TOKENS = 4000
"""4 s per stream at the synthetic model's 1,000 tokens/s: long enough to sample all 16 running."""


def test_sixteen_callers_run_at_once_on_workers_started_with_router_and_prober(tmp_path: Path) -> None:
    mesh = Mesh(MeshConfig(port=0, log_dir=str(tmp_path / "logs")))
    try:
        # `tokenmesh worker` x3, each with its own Triton and 64 slots, no pinning, router and prober: all at
        # once, as Kubernetes starts pods (the router and prober come up long before any worker's model loads).
        addresses = [f"127.0.0.1:{free_port_on('127.0.0.1')}" for _ in range(WORKERS)]
        for i, address in enumerate(addresses):
            mesh.workers.append(
                mesh.spawn(
                    f"worker-{i}",
                    "worker",
                    *("--port", address.rsplit(":", 1)[1], "--work-dir", str(tmp_path / f"worker-{i}")),
                    *("--model-repository", str(SHIPPED_REPOSITORIES["synthetic"])),
                )
            )
        router_address = f"127.0.0.1:{free_port_on('127.0.0.1')}"
        workers = ",".join(addresses)
        mesh.router = mesh.spawn("router", "router", "--port", router_address.rsplit(":", 1)[1], "--workers", workers)
        mesh.prober = mesh.spawn("prober", "prober", "--port", "0", "--workers", workers, "--routers", router_address)
        mesh.wait_ready([*mesh.workers, mesh.router, mesh.prober])
        pids = mesh_pids(mesh)
        with grpc.insecure_channel(mesh.router.address) as channel:
            wait_all_serving(channel, WORKERS)
            inference = inference_pb2_grpc.InferenceStub(channel)
            operator = router_pb2_grpc.RouterStub(channel)
            samples: list[router_pb2.RoutingTable] = []
            done = threading.Event()

            def sample() -> None:
                while not done.wait(0.05):
                    samples.append(operator.GetRoutingTable(router_pb2.GetRoutingTableRequest(), timeout=5))

            def call(i: int) -> inference_pb2.GenerateChunk:
                request = inference_pb2.GenerateRequest(prompt=f"caller {i}", max_tokens=TOKENS, request_id=f"c{i}")
                return list(inference.Generate(request, timeout=120))[-1]

            sampler = threading.Thread(target=sample)
            sampler.start()
            try:
                with ThreadPoolExecutor(CALLERS) as pool:
                    finals = list(pool.map(call, range(CALLERS)))
            finally:
                done.set()
                sampler.join()
    finally:
        mesh.stop()
    assert not left_behind(pids)

    assert [f.finish_reason for f in finals] == [inference_pb2.FINISH_REASON_LENGTH] * CALLERS
    assert [f.usage.completion_tokens for f in finals] == [TOKENS] * CALLERS
    # Nothing waited in the router: every caller got a worker slot at once.
    assert max(f.timing.queue_ms for f in finals) < 50, [round(f.timing.queue_ms) for f in finals]
    assert all(s.queued == 0 for s in samples), [s.queued for s in samples if s.queued]
    # All 16 ran at once, spread over the three workers (16 = 6 + 5 + 5).
    full = [s for s in samples if sum(w.in_flight for w in s.workers) == CALLERS]
    assert full, f"never {CALLERS} in flight: {[sum(w.in_flight for w in s.workers) for s in samples]}"
    assert all(sorted(w.in_flight for w in s.workers) == [5, 5, 6] for s in full), [
        [(w.in_flight, w.weight, w.concurrency_limit) for w in s.workers] for s in full
    ]
    # Limits never fell below the demand: the engines' 64 slots each, all along.
    limits = {w.concurrency_limit for s in samples for w in s.workers}
    assert limits == {64}, limits
