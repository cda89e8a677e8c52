"""Resume on the real mesh: after the caller disconnects, and after the router is killed and replaced."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import grpc
import pytest

from tokenmesh.v1 import inference_pb2, inference_pb2_grpc

from .conftest import MeshHandle, left_behind, mesh_pids, start_mesh, wait_all_serving

pytestmark = pytest.mark.integration

TOKENS = 120


def check_whole(chunks: list[inference_pb2.GenerateChunk]) -> None:
    assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1))
    final = chunks[-1]
    assert final.finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert sum(c.token_count for c in chunks) == final.usage.completion_tokens == TOKENS


def test_resume_after_caller_disconnect_and_after_router_replaced(tmp_path: Path) -> None:
    mesh = start_mesh(tmp_path)
    pids = mesh_pids(mesh)
    try:
        handle = MeshHandle(mesh)
        wait_all_serving(handle.channel, 2)
        request = inference_pb2.GenerateRequest(prompt="Once upon a time", max_tokens=TOKENS, ignore_eos=True)

        # 1. The caller's stream drops; the generation goes on; Resume picks it up.
        request.request_id = "resume-disconnect"
        call = handle.inference.Generate(request, timeout=120)
        first = [next(call) for _ in range(5)]
        call.cancel()
        rest = list(
            handle.inference.Resume(
                inference_pb2.ResumeRequest(request_id="resume-disconnect", after_seq=5), timeout=120
            )
        )
        check_whole(first + rest)

        # 2. The router dies (SIGKILL) mid-stream; a new router on the same port resumes it.
        request.request_id = "resume-router"
        call = handle.inference.Generate(request, timeout=120)
        first = [next(call) for _ in range(8)]
        assert mesh.router is not None
        old = mesh.router
        os.kill(old.proc.pid, signal.SIGKILL)
        old.proc.wait(10)
        handle.channel.close()
        port = old.address.rsplit(":", 1)[1]
        addresses = ",".join(w.address for w in mesh.workers)
        mesh.router = mesh.spawn("router-2", "router", "--host", "127.0.0.1", "--port", port, "--workers", addresses)
        mesh.wait_ready([mesh.router])
        pids.append(mesh.router.proc.pid)
        with grpc.insecure_channel(mesh.router.address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            rest = list(
                stub.Resume(
                    inference_pb2.ResumeRequest(request_id="resume-router", after_seq=8),
                    timeout=120,
                    wait_for_ready=True,
                )
            )
            check_whole(first + rest)
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Resume(inference_pb2.ResumeRequest(request_id="resume-router", after_seq=10_000), timeout=30))
            assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Resume(inference_pb2.ResumeRequest(request_id="no-such-id"), timeout=30))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        mesh.stop()
    leftovers = left_behind(pids)
    assert not leftovers, f"processes left behind: {leftovers}"
