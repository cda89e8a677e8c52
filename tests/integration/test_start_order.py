"""Services started in any order, as Kubernetes starts pods, and a worker restarted under a running prober.

Every service gets its port before any starts (as a Service name would give it), so a router or prober can be
started before the workers it names exist. Whatever the order, once the workers serve, every worker's
``concurrency_limit`` in the router's table is its engine's slots (64, the synthetic model's) within two probe
intervals: nothing a service computes once may depend on a peer having been up first.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
import pytest

from tests.support.dns_server import free_port_on
from tokenmesh.mesh import Child, Mesh, MeshConfig
from tokenmesh.v1 import router_pb2, router_pb2_grpc
from tokenmesh.worker.triton import SHIPPED_REPOSITORIES

from .conftest import left_behind, mesh_pids, wait_all_serving

pytestmark = pytest.mark.integration

WORKERS = 2
SLOTS = 64
"""The synthetic model's instance slots (config.pbtxt)."""
INTERVAL_S = 0.5
"""The prober's stats interval (its default)."""
HOST = "127.0.0.1"

ORDERS = {
    "prober first": ["prober", "workers", "router"],
    "router first": ["router", "workers", "prober"],
    "workers last": ["router", "prober", "workers"],
    "all at once": [],
}


class Cluster:
    """Ports chosen up front; each tier spawned on demand."""

    def __init__(self, mesh: Mesh, tmp: Path) -> None:
        self.mesh = mesh
        self.tmp = tmp
        self.worker_addresses = [f"{HOST}:{free_port_on(HOST)}" for _ in range(WORKERS)]
        self.router_address = f"{HOST}:{free_port_on(HOST)}"
        self.pids: list[int] = []

    def worker(self, i: int) -> Child:
        port = self.worker_addresses[i].rsplit(":", 1)[1]
        return self.mesh.spawn(
            f"worker-{i}",
            "worker",
            *("--host", HOST, "--port", port, "--work-dir", str(self.tmp / f"worker-{i}")),
            *("--model-repository", str(SHIPPED_REPOSITORIES["synthetic"])),
        )

    def start(self, tier: str) -> list[Child]:
        workers = ",".join(self.worker_addresses)
        if tier == "workers":
            self.mesh.workers = [self.worker(i) for i in range(WORKERS)]
            return self.mesh.workers
        if tier == "router":
            port = self.router_address.rsplit(":", 1)[1]
            self.mesh.router = self.mesh.spawn("router", "router", "--host", HOST, "--port", port, "--workers", workers)
            return [self.mesh.router]
        self.mesh.prober = self.mesh.spawn(
            "prober",
            "prober",
            *("--host", HOST, "--port", "0", "--workers", workers, "--routers", self.router_address),
            *("--interval-s", str(INTERVAL_S)),
        )
        return [self.mesh.prober]

    def start_in(self, order: list[str]) -> None:
        """Each tier once the one before is ready; all three at once for an empty order."""
        tiers = order or ["router", "prober", "workers"]
        started = [child for tier in tiers for child in self._started(tier, wait=bool(order))]
        self.mesh.wait_ready(started)

    def _started(self, tier: str, *, wait: bool) -> list[Child]:
        children = self.start(tier)
        if wait:
            self.mesh.wait_ready(children)
        return children

    def note_pids(self) -> None:
        self.pids += [pid for pid in mesh_pids(self.mesh) if pid not in self.pids]


def wait_not_serving(channel: grpc.Channel, address: str, timeout_s: float = 15) -> None:
    stub = router_pb2_grpc.RouterStub(channel)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        table = stub.GetRoutingTable(router_pb2.GetRoutingTableRequest(), timeout=5)
        if all(w.state != router_pb2.WORKER_STATE_SERVING for w in table.workers if w.address == address):
            return
        time.sleep(0.05)
    raise AssertionError(f"the router still sees {address} serving {timeout_s:g} s after it was killed")


def limits_reach_slots(channel: grpc.Channel, within_s: float) -> list[int]:
    """The workers' concurrency limits once all are SLOTS, or the last seen after within_s (then the test fails)."""
    stub = router_pb2_grpc.RouterStub(channel)
    deadline = time.monotonic() + within_s
    while True:
        table = stub.GetRoutingTable(router_pb2.GetRoutingTableRequest(), timeout=5)
        limits = [w.concurrency_limit for w in table.workers]
        if limits == [SLOTS] * WORKERS or time.monotonic() > deadline:
            return limits
        time.sleep(0.05)


@pytest.mark.parametrize("order", list(ORDERS))
def test_every_worker_reports_its_slots_whatever_the_start_order(order: str, tmp_path: Path) -> None:
    mesh = Mesh(MeshConfig(port=0, log_dir=str(tmp_path / "logs")))
    cluster = Cluster(mesh, tmp_path)
    try:
        cluster.start_in(ORDERS[order])
        cluster.note_pids()
        with grpc.insecure_channel(cluster.router_address) as channel:
            wait_all_serving(channel, WORKERS, timeout=60)
            assert limits_reach_slots(channel, 2 * INTERVAL_S) == [SLOTS] * WORKERS
            if order == "all at once":
                # A worker SIGKILLed and started again on its port while the prober runs: its stats stream
                # reconnects long before its Triton has loaded the model.
                old = mesh.workers[0]
                old.proc.send_signal(signal.SIGKILL)
                old.proc.wait(10)
                wait_not_serving(channel, old.address)  # else the table read next could predate the kill
                mesh.workers[0] = cluster.worker(0)
                mesh.wait_ready([mesh.workers[0]])
                cluster.note_pids()
                wait_all_serving(channel, WORKERS, timeout=60)
                assert limits_reach_slots(channel, 2 * INTERVAL_S) == [SLOTS] * WORKERS
    finally:
        cluster.note_pids()
        mesh.stop()
    assert not left_behind(cluster.pids)
