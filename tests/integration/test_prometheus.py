"""A real Prometheus (Debian's package) scrapes every service of a running mesh; a worker is killed mid-stream."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from tests.support.dns_server import free_port_on
from tokenmesh.mesh import Mesh, MeshConfig
from tokenmesh.process import stop_process
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc
from tokenmesh.worker.triton import synthetic_repository

from .conftest import left_behind, mesh_pids, wait_all_serving

pytestmark = pytest.mark.integration

STREAMS = 6
TOKENS = 3000
"""3 s per stream at the synthetic model's 1,000 tokens/s: a worker dies under them."""


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if not found:
        pytest.fail("prometheus not found: `make test-deps` installs Debian's package")
    return found


def query(base: str, expression: str) -> float:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
    answer = json.loads(urllib.request.urlopen(url, timeout=5).read())  # noqa: S310 - our own loopback server
    assert answer["status"] == "success", answer
    result = answer["data"]["result"]
    return float(result[0]["value"][1]) if result else 0.0


def test_prometheus_scrapes_the_mesh_and_sees_ttft_and_migrations(tmp_path: Path) -> None:
    binary = prometheus_binary()
    repository = synthetic_repository(tmp_path)
    mesh = Mesh(MeshConfig(port=0, metrics=True, model_repository=str(repository), log_dir=str(tmp_path / "logs")))
    prometheus: subprocess.Popen[bytes] | None = None
    pids: list[int] = []
    try:
        mesh.start()
        pids = mesh_pids(mesh)
        targets = [url.removeprefix("http://").removesuffix("/metrics") for url in mesh.metrics_urls.values()]
        config = tmp_path / "prometheus.yml"
        config.write_text(
            json.dumps(
                {  # YAML is a superset of JSON
                    "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
                    "scrape_configs": [{"job_name": "tokenmesh", "static_configs": [{"targets": targets}]}],
                }
            )
        )
        port = free_port_on("127.0.0.1")
        prometheus = subprocess.Popen(  # noqa: S603 - Debian's prometheus, our config
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=(tmp_path / "prometheus.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while query_ready(base) is False:
            assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()[-2000:]
            time.sleep(0.2)
        assert mesh.router is not None
        with grpc.insecure_channel(mesh.router.address) as channel:
            wait_all_serving(channel, 2)
            inference = inference_pb2_grpc.InferenceStub(channel)

            def stream(i: int) -> inference_pb2.GenerateChunk:
                request = inference_pb2.GenerateRequest(prompt=f"s{i}", max_tokens=TOKENS)
                return list(inference.Generate(request, timeout=120))[-1]

            with ThreadPoolExecutor(STREAMS) as pool:
                running = [pool.submit(stream, i) for i in range(STREAMS)]
                time.sleep(1.0)  # every stream under way, three per worker
                os.kill(mesh.workers[0].proc.pid, signal.SIGKILL)
                finals = [f.result() for f in running]
        moved = sum(f.migrations for f in finals)
        time.sleep(3)  # a few scrapes after the last stream ended
        ttft = query(base, "sum(tokenmesh_router_time_to_first_token_seconds_count)")
        migrations = query(base, "sum(tokenmesh_router_migrations_total)")
        finished = query(base, 'sum(tokenmesh_router_requests_total{outcome="length"})')
        up = query(base, "sum(up)")
    finally:
        if prometheus is not None:
            stop_process(prometheus, 10)
        mesh.stop()
    assert not left_behind(pids)

    assert [f.finish_reason for f in finals] == [inference_pb2.FINISH_REASON_LENGTH] * STREAMS
    assert [f.usage.completion_tokens for f in finals] == [TOKENS] * STREAMS
    assert moved >= 1  # the killed worker's streams went on elsewhere
    assert ttft == STREAMS
    assert finished == STREAMS
    assert migrations == moved
    assert up == len(mesh.metrics_urls) - 1  # every service scraped, but the killed worker


def query_ready(base: str) -> bool:
    try:
        return bool(urllib.request.urlopen(f"{base}/-/ready", timeout=2).status == 200)  # noqa: S310
    except OSError:
        return False
