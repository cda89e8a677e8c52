"""A worker killed with SIGKILL: weight 0 within 2 s, new generations go to the other one."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from tokenmesh.v1 import inference_pb2, inference_pb2_grpc

from .conftest import MeshHandle, alive, left_behind, mesh_pids, start_mesh, wait_all_serving

pytestmark = pytest.mark.integration


def test_killed_worker_weight_drops_and_traffic_moves(tmp_path: Path) -> None:
    real = start_mesh(tmp_path)
    pids = mesh_pids(real)
    try:
        handle = MeshHandle(real)
        wait_all_serving(handle.channel, 2)
        victim = real.workers[0]
        killed_at = time.monotonic()
        os.kill(victim.proc.pid, signal.SIGKILL)
        while True:
            entry = next(w for w in handle.table().workers if w.address == victim.address)
            if entry.weight == 0:
                break
            assert time.monotonic() - killed_at < 2.0, f"weight still {entry.weight} after 2 s"
            time.sleep(0.02)
        elapsed = time.monotonic() - killed_at
        assert elapsed < 2.0
        # Its Triton dies with it (no orphan holding the device).
        deadline = time.monotonic() + 10
        while alive(int(victim.info["triton_pid"])) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(int(victim.info["triton_pid"]))

        stub = inference_pb2_grpc.InferenceStub(handle.channel)
        survivor = real.workers[1].address
        before = next(w.served_total for w in handle.table().workers if w.address == survivor)
        for i in range(4):
            chunks = list(stub.Generate(inference_pb2.GenerateRequest(prompt="Hi", max_tokens=4, seed=i), timeout=60))
            assert chunks[-1].finish_reason in (inference_pb2.FINISH_REASON_STOP, inference_pb2.FINISH_REASON_LENGTH)
        after = next(w.served_total for w in handle.table().workers if w.address == survivor)
        assert after - before == 4
        handle.channel.close()
    finally:
        real.stop()
    leftovers = left_behind(pids)
    assert not leftovers, f"processes left behind: {leftovers}"


def test_generate_with_no_live_worker_is_unavailable(tmp_path: Path) -> None:
    real = start_mesh(tmp_path, workers=1)
    try:
        handle = MeshHandle(real)
        wait_all_serving(handle.channel, 1)
        os.kill(real.workers[0].proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while handle.table().workers[0].weight != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as info:
            list(handle.inference.Generate(inference_pb2.GenerateRequest(prompt="Hi"), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no live worker" in info.value.details()
        handle.channel.close()
    finally:
        real.stop()
