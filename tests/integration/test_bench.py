"""tokenmesh bench against the real mesh and its Triton servers; the synthetic model on a real Triton."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tokenmesh.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
from tokenmesh.worker.triton import SHIPPED_REPOSITORIES, synthetic_repository

from .conftest import MeshHandle, running_mesh

pytestmark = pytest.mark.integration


def test_bench_compare_finds_the_tritons_through_the_mesh(mesh: MeshHandle, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmesh",
            "bench",
            "--addr",
            mesh.address,
            "--compare",
            "--requests",
            "4",
            "--blocks",
            "2",
            "--concurrency",
            "2",
            "--warmup",
            "1",
            "--input-tokens",
            "16",
            "--output-tokens",
            "6",
            "--progress",
            "off",
            "--json",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    document = json.loads(report.read_text())
    for target in ("mesh", "triton"):
        summary = document["summaries"][target]
        # ignore_eos: exactly the tokens asked for, on every request, none interrupted.
        assert (summary["successful"], summary["output_tokens"], summary["interruption_rate"]) == (4, 24, 0.0)
        assert summary["ttft_s"]["p50"] > 0 and summary["itl_s"]["p50"] > 0
    ratios = document["mesh_over_direct"]
    assert ratios["output_tokens_per_s_ratio"] > 0 and ratios["ttft_p50_ratio"] > 0
    assert len(ratios["ttft_p50_overhead_by_block_ms"]) == 2
    # The mesh's own account: it added something, less than the whole TTFT.
    assert 0 < ratios["ttft_added_p50_ms"] < document["summaries"]["mesh"]["ttft_s"]["p50"] * 1000
    assert "mesh / direct Triton" in out.stdout
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmesh",
            "bench",
            "--target",
            "triton",
            "--model",
            "nope",
            "--triton-url",
            str(mesh.mesh.workers[0].info["triton_url"]),
            "--progress",
            "off",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "model 'nope' is not ready on Triton" in bad.stderr
    assert "smollm2" in bad.stderr and "Traceback" not in bad.stderr


def test_synthetic_model_streams_placeholder_tokens_at_its_rate(mesh: MeshHandle) -> None:
    child = mesh.mesh.spawn(
        "synthetic-worker", "worker", "--port", "0", "--model-repository", str(SHIPPED_REPOSITORIES["synthetic"])
    )
    try:
        mesh.mesh.wait_ready([child])
        with grpc.insecure_channel(child.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            described = stub.Describe(worker_pb2.DescribeRequest(), timeout=5)
            assert [(m.name, m.max_context) for m in described.models] == [("synthetic", 4096)]
            start = worker_pb2.WorkerCommand(
                start=inference_pb2.GenerateRequest(prompt="one two three", max_tokens=200, request_id="synthetic-1")
            )
            began = time.monotonic()
            events = list(stub.Generate(iter([start]), timeout=60))
            took = time.monotonic() - began
        chunks = [e.chunk for e in events if e.HasField("chunk")]
        assert "".join(c.text for c in chunks) == "".join(f" t{i}" for i in range(200))
        assert sum(c.token_count for c in chunks) == 200 and max(c.token_count for c in chunks) >= 5
        end = events[-1].end
        assert (end.finish_reason, end.usage.prompt_tokens, end.usage.completion_tokens) == (
            inference_pb2.FINISH_REASON_LENGTH,
            3,
            200,
        )
        assert 0.2 <= took < 5  # 1,000 tokens/s per stream
    finally:
        child.proc.terminate()
        child.proc.wait(30)


@pytest.fixture(scope="module")
def synthetic_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshHandle]:
    """One worker on the synthetic model (a real Triton), with the gateway."""
    tmp = tmp_path_factory.mktemp("bench-synthetic")
    repository = synthetic_repository(tmp, tokens_per_s=1000)
    with running_mesh(tmp, workers=1, model_repository=str(repository), gateway_port=0) as handle:
        yield handle


@pytest.mark.parametrize("api", ["chat", "completions", "responses", "messages"])
def test_bench_measures_each_api_through_the_gateway(synthetic_mesh: MeshHandle, api: str, tmp_path: Path) -> None:
    assert synthetic_mesh.mesh.gateway is not None
    report = tmp_path / "report.json"
    out = subprocess.run(
        [
            *(sys.executable, "-m", "tokenmesh", "bench", "--progress", "off", "--json", str(report)),
            *("--target", "openai", "--url", str(synthetic_mesh.mesh.gateway.info["url"]), "--api", api),
            *("--requests", "16", "--concurrency", "4", "--warmup", "1", "--output-tokens", "40"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(report.read_text())["summaries"]["openai"]
    assert (summary["successful"], summary["output_tokens"], summary["interruption_rate"]) == (16, 16 * 40, 0.0)
    # The synthetic engine: 40 tokens at 1,000 tokens/s per stream, 5 per response: ~8 text events 5 ms apart.
    assert 0 < summary["ttft_s"]["p50"] < summary["e2e_s"]["p50"] < 1.0
    assert 0.001 < summary["itl_s"]["p50"] < 0.05
    assert "output tokens/s" in out.stdout
