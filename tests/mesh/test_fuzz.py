"""A short fuzz run in `make test`: hostile bytes and field values at every RPC of real servers (FakeBackend).

The long run against a real mesh is benchmarks/fuzz.py. Each call must end in a status the caller can act on,
never UNKNOWN or INTERNAL; afterwards every service still serves, and no weight table was applied.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings

from tests.support.fuzz_targets import BROKEN, TARGETS, WORKER_TARGETS, call, payloads
from tests.support.mesh import in_process_mesh
from tokenmesh.certs import make_dev_certs
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc

EXAMPLES = 300


class ThreadedMesh:
    """An in-process mesh served from an event loop of its own (hypothesis drives it with blocking calls)."""

    def __init__(self, **settings: Any) -> None:
        self.settings = settings
        self.ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.mesh: Any = None
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._serve(),), daemon=True)
        self._stop: asyncio.Event | None = None

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with in_process_mesh(**self.settings) as mesh:
            self.mesh = mesh
            self.ready.set()
            await self._stop.wait()

    def __enter__(self) -> ThreadedMesh:
        self.thread.start()
        assert self.ready.wait(30), "mesh did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(30)


@pytest.fixture(scope="module")
def plain() -> Iterator[ThreadedMesh]:
    with ThreadedMesh() as mesh:
        yield mesh


def still_serving(mesh: ThreadedMesh) -> None:
    with grpc.insecure_channel(mesh.mesh.router.host.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        chunks = list(stub.Generate(inference_pb2.GenerateRequest(prompt="still there?", max_tokens=3), timeout=10))
    assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(payload=payloads([t for t in TARGETS if ".Control/" not in t[0]]))
def test_hostile_input_to_the_router_gets_a_status(plain: ThreadedMesh, payload: tuple[str, str, bytes]) -> None:
    method, kind, data = payload
    with grpc.insecure_channel(plain.mesh.router.host.address) as channel:
        status = call(channel, method, kind, data)
    assert status not in BROKEN, (method, data[:80])


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(payload=payloads(WORKER_TARGETS))
def test_hostile_input_to_a_worker_gets_a_status(plain: ThreadedMesh, payload: tuple[str, str, bytes]) -> None:
    method, kind, data = payload
    with grpc.insecure_channel(plain.mesh.workers[0].host.address) as channel:
        status = call(channel, method, kind, data, timeout=3)
    assert status not in BROKEN, (method, data[:80])


def test_the_plaintext_mesh_still_serves_after_the_fuzz(plain: ThreadedMesh) -> None:
    still_serving(plain)
    assert plain.mesh.router.pool.version == 0  # no weight table ever applied


@pytest.fixture(scope="module")
def mutual(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ThreadedMesh, Path]]:
    folder = make_dev_certs(tmp_path_factory.mktemp("certs"))
    flags = {"tls_mode": "mtls", "tls_ca": str(folder / "ca.crt")}
    router = {**flags, "tls_cert": str(folder / "router.crt"), "tls_key": str(folder / "router.key")}
    worker = {**flags, "tls_cert": str(folder / "worker.crt"), "tls_key": str(folder / "worker.key")}
    with ThreadedMesh(worker_settings=worker, **router) as mesh:
        yield mesh, folder


@settings(max_examples=EXAMPLES // 2, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(payload=payloads([t for t in TARGETS if ".Control/" in t[0]] + WORKER_TARGETS))
def test_a_client_identity_is_refused_control_and_worker_calls_whatever_it_sends(
    mutual: tuple[ThreadedMesh, Path], payload: tuple[str, str, bytes]
) -> None:
    mesh, folder = mutual
    method, kind, data = payload
    credentials = grpc.ssl_channel_credentials(
        (folder / "ca.crt").read_bytes(), (folder / "client.key").read_bytes(), (folder / "client.crt").read_bytes()
    )
    address = mesh.mesh.router.host.address if ".Control/" in method else mesh.mesh.workers[0].host.address
    with grpc.secure_channel(address, credentials) as channel:
        assert call(channel, method, kind, data) == "PERMISSION_DENIED"
    assert mesh.mesh.router.pool.version == 0
