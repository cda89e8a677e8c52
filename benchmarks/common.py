"""Shared helpers for the benchmarks: a mesh to measure, streams, percentiles, RSS.

``percentile`` is ``tokenmesh bench``'s (linear between ranks), so every figure
the project prints uses one definition.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil

from tokenmesh.__main__ import set_grpc_defaults
from tokenmesh.bench.metrics import percentile as percentile  # the benchmarks' percentile is tokenmesh bench's
from tokenmesh.mesh import Mesh, MeshConfig
from tokenmesh.process import dies_with_parent
from tokenmesh.tls import Tls, TlsSettings
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, router_pb2, router_pb2_grpc
from tokenmesh.worker.triton import synthetic_repository as synthetic_repository  # one copy, in the package

# The repository root, for the helpers the benchmarks share with the tests (one copy, in tests/support);
# every benchmark imports this module first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.processes import cpu_seconds as cpu_seconds  # noqa: E402
from tests.support.processes import descendants as descendants  # noqa: E402
from tests.support.quotas import OWN_CONNECTION as OWN_CONNECTION  # noqa: E402
from tests.support.quotas import refusal_of as refusal_of  # noqa: E402
from tests.support.quotas import served_by_process as served_by_process  # noqa: E402
from tests.support.redis_server import RedisServer as RedisServer  # noqa: E402


def rss_mb(pid: int) -> float:
    """Resident set size of a process in MiB."""
    return float(psutil.Process(pid).memory_info().rss) / 2**20


def tree_rss_mb(pid: int) -> float:
    """RSS of a process and all its descendants, MiB."""
    total = 0.0
    for member in descendants(pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += rss_mb(member)
    return total


def free_port() -> int:
    """A port free on loopback now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_relay(*args: str) -> subprocess.Popen[bytes]:
    """Run relay.py (the one-hop baseline's source or relay) as a child that dies with us.

    With the gRPC settings the ``tokenmesh`` command gives the services it
    runs (tokenmesh/__main__.py), so the baseline and the mesh compare like for like.
    """
    script = Path(__file__).parent / "relay.py"
    env = dict(os.environ)
    set_grpc_defaults(env)
    return subprocess.Popen(dies_with_parent([sys.executable, str(script), *args]), env=env)  # noqa: S603


def tree_cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process and its descendants (those alive now) have used."""
    return cpu_seconds(descendants(pid))


@contextlib.contextmanager
def running_mesh(config: MeshConfig, routable: int | None = None) -> Iterator[Mesh]:
    """The embedded mesh, logging to a temporary folder, until every worker is routable; stopped after.

    With config.tls_dir the mesh runs mutual TLS, and the readiness check presents the folder's client certificate.
    """
    with tempfile.TemporaryDirectory() as logs:
        mesh = Mesh(dataclasses.replace(config, log_dir=config.log_dir or logs))
        mesh.start()
        try:
            wait_routable(mesh, routable if routable is not None else config.workers)
            yield mesh
        finally:
            mesh.stop()


def client_credentials(tls_dir: str) -> grpc.ChannelCredentials:
    """The `client` identity of a `tokenmesh certs` folder."""
    folder = Path(tls_dir)
    settings = TlsSettings(
        tls_mode="mtls",
        tls_cert=str(folder / "client.crt"),
        tls_key=str(folder / "client.key"),
        tls_ca=str(folder / "ca.crt"),
    )
    credentials = Tls(settings).credentials()
    assert credentials is not None
    return credentials


def wait_routable(mesh: Mesh, count: int, timeout: float = 60) -> None:
    """Until the router has count workers with weight > 0."""
    assert mesh.router is not None
    tls_dir = mesh.config.tls_dir
    with (
        grpc.secure_channel(mesh.router.address, client_credentials(tls_dir))
        if tls_dir
        else grpc.insecure_channel(mesh.router.address)
    ) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        deadline = time.monotonic() + timeout
        while True:
            table = stub.GetRoutingTable(router_pb2.GetRoutingTableRequest())
            if sum(w.weight > 0 for w in table.workers) >= count:
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"fewer than {count} workers routable after {timeout:.0f} s:\n{table}")
            time.sleep(0.1)


@dataclass
class StreamResult:
    """What one client saw of one stream."""

    chunks: int = 0
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    """Seconds between consecutive chunks."""
    error: str = ""
    seq_ok: bool = True
    finish: int = 0
    completion_tokens: int = 0
    migrations: int = 0

    @property
    def interrupted(self) -> bool:
        """Ended in an error, or with a seq gap, repeat, or lost tokens."""
        return bool(self.error) or not self.seq_ok or self.finish == 0 or self.tokens != self.completion_tokens


def run_stream(
    stub: inference_pb2_grpc.InferenceStub, request: inference_pb2.GenerateRequest, timeout: float
) -> StreamResult:
    """Consume one Generate stream and check its seq and token accounting."""
    result = StreamResult()
    last = time.monotonic()
    try:
        for chunk in stub.Generate(request, timeout=timeout):
            now = time.monotonic()
            if result.chunks:
                result.gaps.append(now - last)
            last = now
            result.chunks += 1
            result.seq_ok &= chunk.seq == result.chunks
            result.tokens += chunk.token_count
            if chunk.finish_reason:
                result.finish = chunk.finish_reason
                result.completion_tokens = chunk.usage.completion_tokens
                result.migrations = chunk.migrations
    except grpc.RpcError as exc:
        result.error = f"{exc.code().name}: {exc.details()}"
    return result
