"""Failure classes on real Triton servers, each with the action taken.

The workers run tests/models/faulty, a test model that fails on demand with
the texts real backends send (CUDA OOM, lost CUDA context); the Triton crash
and the drains use real signals.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from tests.support.processes import descendants
from tokenmesh.v1 import inference_pb2, router_pb2, worker_pb2, worker_pb2_grpc

from .conftest import MeshHandle, alive, left_behind, mesh_pids, running_mesh, start_mesh, wait_all_serving

pytestmark = pytest.mark.integration

FAULTY = str(Path(__file__).resolve().parents[1] / "models")


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshHandle]:
    with running_mesh(tmp_path_factory.mktemp("faulty"), model_repository=FAULTY) as handle:
        yield handle


def worker_stats(address: str) -> worker_pb2.WorkerStats:
    with grpc.insecure_channel(address) as channel:
        return next(worker_pb2_grpc.WorkerStub(channel).Stats(iter([worker_pb2.StatsPing(ping_id=1)]), timeout=5))


def claim(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.write_text("one worker takes this fault")
    return path


def generate(handle: MeshHandle, prompt: str, max_tokens: int = 5) -> list[inference_pb2.GenerateChunk]:
    return list(
        handle.inference.Generate(inference_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens), timeout=60)
    )


def wait_for(predicate, timeout: float = 30, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_device_oom_lowers_limit_and_weight_and_the_request_runs_elsewhere(faulty: MeshHandle, tmp_path) -> None:
    chunks = generate(faulty, f"fault:oom:{claim(tmp_path, 'oom')}")
    assert "".join(c.text for c in chunks) == "tok0 tok1 tok2 tok3 tok4 "  # retried on the other worker
    stats = {w.address: worker_stats(w.address) for w in faulty.mesh.workers}
    hit = next(a for a, s in stats.items() if s.oom_total == 1)
    assert stats[hit].concurrency_limit < 4 and stats[hit].serving
    entry = wait_for(
        lambda: next(
            (w for w in faulty.table().workers if w.address == hit and "device out of memory" in w.reason), None
        ),
        5,
        "OOM weight",
    )
    other = next(w for w in faulty.table().workers if w.address != hit)
    assert entry.weight < other.weight and entry.state == router_pb2.WORKER_STATE_SERVING


def wait_all_routable(handle: MeshHandle) -> None:
    """Until no worker is avoided after an earlier test's fault and all are SERVING."""
    wait_for(
        lambda: all(
            w.weight > 0 and w.state == router_pb2.WORKER_STATE_SERVING and "avoided" not in w.reason
            for w in handle.table().workers
        ),
        30,
        "all workers routable",
    )


def test_lost_cuda_context_restarts_triton_then_serves_again(faulty: MeshHandle, tmp_path) -> None:
    wait_all_routable(faulty)
    before = {w.address: worker_stats(w.address) for w in faulty.mesh.workers}
    chunks = generate(faulty, f"fault:cudalost:{claim(tmp_path, 'lost')}")
    assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH  # ran on the other worker

    def restarted() -> str | None:
        for address, old in before.items():
            now = worker_stats(address)
            if now.backend_restarts == old.backend_restarts + 1 and now.serving:
                return address
        return None

    hit = wait_for(restarted, 60, "backend restart")
    assert worker_stats(hit).triton_url != before[hit].triton_url  # a new Triton
    # And it works again (the lost context is gone with the old Triton).
    with grpc.insecure_channel(hit) as channel:
        start = worker_pb2.WorkerCommand(
            start=inference_pb2.GenerateRequest(prompt="x", max_tokens=3, request_id="after-restart")
        )
        events = list(worker_pb2_grpc.WorkerStub(channel).Generate(iter([start]), timeout=30))
    assert events[-1].WhichOneof("event") == "end"


def describe(address: str) -> worker_pb2.DescribeResponse:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=5)


def shm_regions(triton_pid: int) -> list[Path]:
    """The /dev/shm regions of a running Triton's Python backend, by the prefix its worker named on its command line."""
    flag = "--backend-config=python,shm-region-prefix-name="
    [prefix] = [a.removeprefix(flag) for a in psutil.Process(triton_pid).cmdline() if a.startswith(flag)]
    return sorted(Path("/dev/shm").glob(f"{prefix}*"))


def test_killed_triton_is_restarted_and_weight_recovers(faulty: MeshHandle) -> None:
    wait_all_routable(faulty)
    worker = faulty.mesh.workers[1]
    before = worker_stats(worker.address)
    old_pid = describe(worker.address).triton_pid
    stubs = descendants(old_pid)[1:]
    assert stubs, "the model's Python stub runs under Triton"
    regions = shm_regions(old_pid)
    assert regions, "Triton's Python backend keeps its regions in /dev/shm, named by the worker's prefix"
    # Killed while generating: a busy stub is the one that outlived its Triton.
    channel = grpc.insecure_channel(worker.address)
    start = worker_pb2.WorkerCommand(
        start=inference_pb2.GenerateRequest(
            prompt="long", max_tokens=1000, ignore_eos=True, request_id="killed-mid-generation"
        )
    )  # 5 s at 5 ms/token
    running = worker_pb2_grpc.WorkerStub(channel).Generate(iter([start]), timeout=60)
    assert next(running).HasField("chunk")
    os.kill(old_pid, signal.SIGKILL)

    def weight() -> float:
        return next(w for w in faulty.table().workers if w.address == worker.address).weight

    wait_for(lambda: weight() == 0, 5, "weight 0 while Triton restarts")

    def restarted() -> worker_pb2.WorkerStats | None:
        now = worker_stats(worker.address)
        return now if now.serving and now.backend_restarts > before.backend_restarts else None

    after = wait_for(restarted, 60, "restart")
    assert after.state_reason == "serving"
    assert describe(worker.address).triton_pid not in (0, old_pid)
    assert not alive(old_pid)
    assert not left_behind(stubs, 5), "a SIGKILLed Triton's model stub must end too"
    assert not [r for r in regions if r.exists()], "the killed Triton's shared memory is removed at its restart"
    with contextlib.suppress(grpc.RpcError):
        list(running)  # ended by the kill
    channel.close()
    wait_for(lambda: weight() > 0, 10, "weight back")


def test_worker_sigterm_drains_in_flight_streams(tmp_path: Path) -> None:
    mesh = start_mesh(tmp_path, 2, model_repository=FAULTY)
    pids = mesh_pids(mesh)
    try:
        handle = MeshHandle(mesh)
        wait_all_serving(handle.channel, 2)
        results: list[list[inference_pb2.GenerateChunk]] = []
        threads = [threading.Thread(target=lambda: results.append(generate(handle, "long", 400))) for _ in range(4)]
        for t in threads:
            t.start()
        wait_for(lambda: all(w.in_flight > 0 for w in handle.table().workers), 10, "both workers busy")
        draining = mesh.workers[0]
        sent = time.monotonic()
        draining.proc.send_signal(signal.SIGTERM)
        wait_for(
            lambda: next(w for w in handle.table().workers if w.address == draining.address).weight == 0,
            2,
            "weight 0 on SIGTERM",
        )
        assert time.monotonic() - sent < 2
        for t in threads:
            t.join(60)
        assert len(results) == 4
        for chunks in results:  # in-flight streams finished (or moved), none broke
            assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1))
            assert "".join(c.text for c in chunks) == "".join(f"tok{i} " for i in range(400))
        assert draining.proc.wait(30) == 0
        handle.channel.close()
    finally:
        mesh.stop()
    assert not left_behind(pids)


def test_router_sigterm_finishes_in_flight_and_refuses_new(tmp_path: Path) -> None:
    mesh = start_mesh(tmp_path, 1, model_repository=FAULTY)
    pids = mesh_pids(mesh)
    try:
        handle = MeshHandle(mesh)
        wait_all_serving(handle.channel, 1)
        call = handle.inference.Generate(inference_pb2.GenerateRequest(prompt="long", max_tokens=300), timeout=60)
        first = next(call)
        assert mesh.router is not None
        mesh.router.proc.send_signal(signal.SIGTERM)
        rest = list(call)
        chunks = [first, *rest]
        assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
        assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1))  # unread tokens may merge into one chunk
        assert chunks[-1].usage.completion_tokens == 300 == sum(c.token_count for c in chunks)
        assert mesh.router.proc.wait(30) == 0
        with pytest.raises(grpc.RpcError) as info:
            generate(handle, "new")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        handle.channel.close()
    finally:
        mesh.stop()
    assert not left_behind(pids)


def test_sigstopped_worker_weight_drops_after_the_probe_deadline_and_recovers(faulty: MeshHandle) -> None:
    wait_all_routable(faulty)
    worker = faulty.mesh.workers[0]

    def entry() -> router_pb2.RoutingEntry:
        return next(w for w in faulty.table().workers if w.address == worker.address)

    os.kill(worker.proc.pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        wait_for(lambda: entry().weight == 0, 5, "weight 0 after SIGSTOP")
        elapsed = time.monotonic() - stopped
        # The probe deadline is 1 s after the last answered ping (pings every 0.1 s): 0 within 500 ms of it.
        assert elapsed < 1.0 + 0.1 + 0.5, f"weight reached 0 after {elapsed:.2f} s"
        assert entry().state == router_pb2.WORKER_STATE_UNREACHABLE
    finally:
        os.kill(worker.proc.pid, signal.SIGCONT)
    wait_for(lambda: entry().weight > 0, 5, "weight back after SIGCONT")
    assert entry().state == router_pb2.WORKER_STATE_SERVING


async def test_triton_port_taken_before_it_binds_is_retried_on_new_ports(tmp_path: Path, monkeypatch) -> None:
    from tokenmesh.worker import triton
    from tokenmesh.worker.triton import _process

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    picks = iter([taken])  # the first (gRPC) port handed to Triton is already in use
    real = _process._free_ports

    def ports(host: str, count: int) -> list[int]:
        fresh = real(host, count)
        first = next(picks, None)
        return fresh if first is None else [first, *fresh[1:]]

    monkeypatch.setattr(_process, "_free_ports", ports)
    process = triton.TritonProcessConfig(work_dir=tmp_path, model_repository=Path(FAULTY))
    backend = triton.TritonBackend(triton.TritonBackendConfig(process=process))
    try:
        await backend.start()
        assert [m.name for m in backend.models()] == ["faulty"]
        assert not backend.endpoint.endswith(f":{taken}")
    finally:
        await backend.stop()
        held.close()
