"""Chaos on the real mesh: workers killed and stopped mid-stream, no stream interrupted."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from tokenmesh.mesh import Mesh, MeshConfig
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc

from .conftest import MeshHandle, left_behind, mesh_pids, wait_all_serving

pytestmark = pytest.mark.integration

STREAMS = 16
TOKENS = 220


def test_sigkill_and_sigstop_mid_stream_interrupt_no_stream(tmp_path: Path) -> None:
    config = MeshConfig(
        workers=3,
        port=0,
        threads=1,
        slots=6,
        log_dir=str(tmp_path / "logs"),
        # One surviving worker on 2 cores finishes all 16 streams; queued
        # continuations may wait long for a slot, which is not a stall.
        extra_env={"TOKENMESH_ROUTER_TTFT_TIMEOUT_S": "120"},
    )
    mesh = Mesh(config)
    mesh.start()
    pids = mesh_pids(mesh)
    stopped: int | None = None
    try:
        handle = MeshHandle(mesh)
        wait_all_serving(handle.channel, 3)
        stub = inference_pb2_grpc.InferenceStub(handle.channel)
        results: dict[int, list[inference_pb2.GenerateChunk]] = {i: [] for i in range(STREAMS)}
        errors: dict[int, BaseException] = {}

        def stream(i: int) -> None:
            request = inference_pb2.GenerateRequest(
                prompt=f"Story number {i}: Once upon a time", max_tokens=TOKENS, ignore_eos=True, seed=i
            )
            try:
                for chunk in stub.Generate(request, timeout=300):
                    results[i].append(chunk)
            except grpc.RpcError as exc:
                errors[i] = exc

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while min(len(r) for r in results.values()) < 10:
            assert time.monotonic() < deadline and not errors, (errors, {i: len(r) for i, r in results.items()})
            time.sleep(0.05)

        in_flight = {w.address: w.in_flight for w in handle.table().workers}
        killed, paused = mesh.workers[0], mesh.workers[1]
        assert in_flight[killed.address] > 0 and in_flight[paused.address] > 0, in_flight
        os.kill(killed.proc.pid, signal.SIGKILL)
        os.kill(paused.proc.pid, signal.SIGSTOP)
        stopped = paused.proc.pid
        time.sleep(8)  # well past the 5 s stall window
        os.kill(paused.proc.pid, signal.SIGCONT)
        stopped = None

        for t in threads:
            t.join(300)
        assert not errors, errors
        for i, chunks in results.items():
            assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1)), f"stream {i}: seq gap or repeat"
            final = chunks[-1]
            assert final.finish_reason == inference_pb2.FINISH_REASON_LENGTH, f"stream {i}: {final}"
            assert sum(c.token_count for c in chunks) == final.usage.completion_tokens == TOKENS, f"stream {i}"
            assert all(c.request_id == final.request_id for c in chunks)
        # The kills are transient failures to the prober and the router: both are still up.
        assert mesh.prober is not None and mesh.prober.proc.poll() is None, mesh.prober.log_tail()
        assert mesh.router is not None and mesh.router.proc.poll() is None, mesh.router.log_tail()
        handle.channel.close()
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        mesh.stop()
    leftovers = left_behind(pids)
    assert not leftovers, f"processes left behind: {leftovers}"
