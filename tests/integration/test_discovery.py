"""--discovery dns with the services started one by one (real Triton, synthetic model) and a real DNS server.

Workers are added to and removed from the name's records while streams run:
a new worker serves within two discovery intervals, a removed one takes no
new work and its streams run to their end; none breaks.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from tests.support.dns_server import DnsServer, free_port_on
from tokenmesh.mesh import Mesh, MeshConfig
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, router_pb2, router_pb2_grpc
from tokenmesh.worker.triton import synthetic_repository

from .conftest import left_behind, mesh_pids

pytestmark = pytest.mark.integration

INTERVAL_S = 1.0
STREAMS = 6
LATE = 4
"""Requests sent once the first worker drains; they must all reach the second."""
TOKENS = 4000
RATE = 500
"""Tokens/s per stream: 8 s per stream, long enough for the records to change twice while they run."""
WORKERS = "workers.mesh.test"


def serving(table: router_pb2.RoutingTable, address: str) -> bool:
    return any(
        w.address == address and w.weight > 0 and w.state == router_pb2.WORKER_STATE_SERVING for w in table.workers
    )


def test_workers_added_and_removed_in_dns_while_streams_run(tmp_path: Path) -> None:
    dns = DnsServer().start()
    hosts = ("127.0.0.1", "127.0.0.2")
    port = free_port_on(*hosts)
    router_port = free_port_on("127.0.0.1")
    first, second = (f"{h}:{port}" for h in hosts)
    dns.zone.set(WORKERS, hosts[0])
    dns.zone.set("routers.mesh.test", "127.0.0.1")
    lookups = ["--discovery", "dns", "--discovery-dns-server", dns.address, "--discovery-interval-s", str(INTERVAL_S)]
    repository = synthetic_repository(tmp_path, tokens_per_s=RATE)
    mesh = Mesh(MeshConfig(port=0, log_dir=str(tmp_path / "logs")))
    pids: list[int] = []
    try:
        for i, host in enumerate(hosts):
            mesh.workers.append(
                mesh.spawn(
                    f"worker-{i}",
                    "worker",
                    "--host",
                    host,
                    "--port",
                    str(port),
                    "--work-dir",
                    str(tmp_path / f"worker-{i}"),
                    "--model-repository",
                    str(repository),
                )
            )
        mesh.wait_ready(mesh.workers)
        mesh.router = mesh.spawn(
            "router", "router", "--port", str(router_port), "--workers", f"{WORKERS}:{port}", *lookups
        )
        mesh.prober = mesh.spawn(
            "prober",
            "prober",
            "--port",
            "0",
            "--workers",
            f"{WORKERS}:{port}",
            "--routers",
            f"routers.mesh.test:{router_port}",
            *lookups,
        )
        mesh.wait_ready([mesh.router, mesh.prober])
        pids = mesh_pids(mesh)
        with grpc.insecure_channel(mesh.router.address) as channel:
            inference = inference_pb2_grpc.InferenceStub(channel)
            operator = router_pb2_grpc.RouterStub(channel)

            def table() -> router_pb2.RoutingTable:
                return operator.GetRoutingTable(router_pb2.GetRoutingTableRequest(), timeout=5)

            def wait_for(predicate, timeout: float) -> float:
                began = time.monotonic()
                while not predicate(table()):
                    assert time.monotonic() - began < timeout, f"not within {timeout} s: {table()}"
                    time.sleep(0.05)
                return time.monotonic() - began

            # The prober found the router by its name and pushed it a table weighing the one listed worker.
            wait_for(lambda t: t.version > 0 and serving(t, first), 30)
            assert [(w.address, w.found_by) for w in table().workers] == [(first, f"dns {WORKERS}:{port}")]

            def stream(i: int) -> list[inference_pb2.GenerateChunk]:
                request = inference_pb2.GenerateRequest(prompt=f"caller {i}", max_tokens=TOKENS, request_id=f"s{i}")
                return list(inference.Generate(request, timeout=120))

            # A thread for each long stream and each late request: the late ones must run while the long ones do.
            with ThreadPoolExecutor(STREAMS + LATE) as pool:
                running = [pool.submit(stream, i) for i in range(STREAMS)]
                wait_for(lambda t: sum(w.in_flight for w in t.workers) == STREAMS, 10)
                # A worker is added to the records: it serves within two intervals.
                dns.zone.set(WORKERS, *hosts)
                joined_s = wait_for(lambda t: serving(t, second), 10)
                # The first one leaves the records: drained, its streams run on.
                dns.zone.set(WORKERS, hosts[1])
                wait_for(
                    lambda t: any(w.address == first and w.reason.startswith("draining") for w in t.workers),
                    3 * INTERVAL_S,
                )
                drained = {w.address: w for w in table().workers}[first]
                assert drained.weight == 0 and drained.in_flight == STREAMS, drained
                served_before = {w.address: w.served_total for w in table().workers}
                # New work goes only to the worker still listed.
                late = [
                    pool.submit(
                        lambda i=i: list(
                            inference.Generate(
                                inference_pb2.GenerateRequest(prompt=f"late {i}", max_tokens=50), timeout=60
                            )
                        )
                    )
                    for i in range(LATE)
                ]
                finals = [f.result()[-1] for f in late]
                rows = {w.address: w for w in table().workers}
                assert rows[first].served_total + rows[first].in_flight == STREAMS  # nothing new went there
                assert rows[second].served_total == served_before[second] + LATE
                results = [f.result() for f in running]
            # Once its streams ended, the drained worker is dropped; the prober's table no longer names it.
            wait_for(lambda t: [w.address for w in t.workers] == [second], 3 * INTERVAL_S)
    finally:
        mesh.stop()
        dns.stop()
    assert not left_behind(pids)

    assert joined_s <= 2 * INTERVAL_S, f"the added worker served after {joined_s:.2f} s"
    assert [f.finish_reason for f in finals] == [inference_pb2.FINISH_REASON_LENGTH] * 4
    for chunks in results:  # none broken: every stream whole, seq contiguous
        assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
        assert chunks[-1].usage.completion_tokens == TOKENS
        assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1))
