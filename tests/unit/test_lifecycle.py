"""One lifecycle for every service and the gateway: supervised loops, liveness vs readiness, idempotent shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.fakes import FakeBackend
from tests.support.mesh import InProcessMesh, wait_until
from tokenmesh.lifecycle import Lifecycle
from tokenmesh.links import Link
from tokenmesh.prober import Prober, ProberConfig
from tokenmesh.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
from tokenmesh.worker import Worker, WorkerConfig

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _health(address: str, name: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=name), timeout=2
        )
        return int(response.status)


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


class _Counter(grpc.aio.ServerInterceptor):
    """Counts the calls a server receives (a bare server answers each UNIMPLEMENTED)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        self.calls.append(handler_call_details.method)
        return await continuation(handler_call_details)


@pytest.fixture
async def bare_server() -> AsyncIterator[tuple[str, _Counter]]:
    """A gRPC server with no services: the address of something that is not a tokenmesh service."""
    counter = _Counter()
    server = grpc.aio.server(interceptors=[counter])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", counter
    finally:
        await server.stop(0)


async def test_a_dying_background_loop_takes_the_service_to_not_serving_and_a_non_zero_exit(
    mesh: InProcessMesh,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    addresses = tuple(w.host.address for w in mesh.workers)
    pushed = asyncio.Event()

    async def broken_push(self: Prober, link: Link) -> None:
        await pushed.wait()
        raise RuntimeError("push loop bug")

    monkeypatch.setattr(Prober, "_push", broken_push)
    prober = Prober(ProberConfig(port=0, workers=addresses, routers=(mesh.router.host.address,), interval_s=0.05))
    run = asyncio.create_task(prober.run())
    try:
        await wait_until(lambda: prober.host.port and prober.host.health.status("readiness") == SERVING)
        address = prober.host.address
        async with grpc.aio.insecure_channel(address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == SERVING
            pushed.set()  # the loop raises now
            assert (await asyncio.wait_for(watch.read(), 5)).status == NOT_SERVING
        assert await asyncio.wait_for(run, 10) == 1
        assert isinstance(prober.failure, RuntimeError)
    finally:
        await prober.shutdown()
        run.cancel()


async def test_a_prober_pointed_at_an_unimplemented_service_fails_loudly_instead_of_spinning(
    bare_server: tuple[str, _Counter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    address, counter = bare_server
    prober = Prober(ProberConfig(port=0, workers=(address,), routers=(address,), interval_s=0.05))
    started = time.monotonic()
    with caplog.at_level(logging.ERROR):
        code = await asyncio.wait_for(prober.run(), 10)
    assert code == 1
    assert time.monotonic() - started < 5
    # Each loop tried once: no retry of a permanent status.
    assert len(counter.calls) <= 3, counter.calls
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(address in e and "UNIMPLEMENTED" in e and "permanently" in e for e in errors), errors


def test_the_prober_process_exits_non_zero_naming_the_wrong_address(tmp_path: Any) -> None:
    """The same through ``tokenmesh prober``: exit code 1 and the address in its log, within seconds."""
    script = (
        "import asyncio, grpc, subprocess, sys\n"
        "async def main():\n"
        "    server = grpc.aio.server(); port = server.add_insecure_port('127.0.0.1:0'); await server.start()\n"
        "    address = f'127.0.0.1:{port}'\n"
        "    proc = await asyncio.create_subprocess_exec(sys.executable, '-m', 'tokenmesh', 'prober', '--port', '0',\n"
        "        '--workers', address, '--routers', address, stderr=subprocess.PIPE)\n"
        "    try:\n"
        "        _, err = await asyncio.wait_for(proc.communicate(), 20)\n"
        "    finally:\n"
        "        if proc.returncode is None: proc.kill(); await proc.wait()\n"
        "    print(proc.returncode, address); sys.stdout.write(err.decode())\n"
        "asyncio.run(main())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    first, _, log = done.stdout.partition("\n")
    code, address = first.split()
    assert code == "1", done.stdout
    assert f"to {address} failed permanently: UNIMPLEMENTED" in log


async def test_repeated_unavailable_is_a_warning_naming_the_address_and_the_prober_keeps_trying(
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker, router = _closed_port(), _closed_port()
    prober = Prober(ProberConfig(port=0, workers=(worker,), routers=(router,), interval_s=0.05))
    with caplog.at_level(logging.WARNING):
        await prober.start()
        try:
            await wait_until(
                lambda: any(router in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING),
                timeout=15,
            )
            await wait_until(
                lambda: any(worker in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING),
                timeout=15,
            )
            assert prober.failure is None
            assert prober.host.health.status("readiness") == SERVING
        finally:
            await prober.shutdown()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("weight push to " + router in w and "UNAVAILABLE" in w for w in warnings), warnings


async def test_liveness_stays_serving_and_readiness_turns_not_serving_while_a_worker_drains() -> None:
    backend = FakeBackend(delay=0.05)
    worker = Worker(WorkerConfig(port=0, drain_grace_s=10), backend=backend)
    await worker.start()
    address = worker.host.address
    stopping: asyncio.Task[None] | None = None
    try:
        assert await _health(address, "liveness") == SERVING
        assert await _health(address, "readiness") == SERVING
        async with grpc.aio.insecure_channel(address) as channel:
            call = worker_pb2_grpc.WorkerStub(channel).Generate()
            start = inference_pb2.GenerateRequest(request_id="draining", prompt="hi", max_tokens=40, model="fake")
            await call.write(worker_pb2.WorkerCommand(start=start, first_seq=1))
            assert (await call.read()).seq == 1  # a generation is in flight (40 x 50 ms)
            stopping = asyncio.create_task(worker.shutdown())
            await wait_until(lambda: worker.host.health.status("readiness") == NOT_SERVING)
            assert await _health(address, "liveness") == SERVING
            assert await _health(address, "readiness") == NOT_SERVING
            assert await _health(address, "") == NOT_SERVING
            assert not stopping.done()  # still draining: the generation runs on
            events = []
            while (event := await call.read()) is not grpc.aio.EOF:
                events.append(event)
                if event.WhichOneof("event") != "chunk":
                    break
            assert events[-1].WhichOneof("event") == "end"
            assert events[-1].end.finish_reason == inference_pb2.FINISH_REASON_LENGTH
        await asyncio.wait_for(stopping, 10)
        assert worker.host.health.status("liveness") == NOT_SERVING
    finally:
        await worker.shutdown()


async def test_shutdown_is_idempotent_and_a_second_caller_waits_for_the_first() -> None:
    backend = FakeBackend()
    worker = Worker(WorkerConfig(port=0, drain_grace_s=1), backend=backend)
    async with worker:
        assert backend.running
        first = asyncio.create_task(worker.shutdown())
        second = asyncio.create_task(worker.shutdown())
        await asyncio.sleep(0)
        await second
        assert first.done() or await asyncio.wait_for(first, 1) is None
        assert not backend.running  # the second returned only once the first had finished
    await worker.shutdown()  # and a third, after `async with` did its own
    with pytest.raises(RuntimeError, match="started already"):
        await worker.start()


async def test_unknown_health_names_get_not_found_or_service_unknown_and_allocate_nothing(
    mesh: InProcessMesh,
) -> None:
    health = mesh.router.host.health
    before = len(health._conditions)
    async with grpc.aio.insecure_channel(mesh.router.host.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("nope", "x" * 1000, "tokenmesh.v1.Nothing"):
            with pytest.raises(grpc.aio.AioRpcError) as check:
                await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=2)
            assert check.value.code() == grpc.StatusCode.NOT_FOUND
            assert "liveness" in (check.value.details() or "")
            watch = stub.Watch(health_pb2.HealthCheckRequest(service=name), timeout=2)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            watch.cancel()
        for name in ("", "liveness", "readiness", "tokenmesh.v1.Inference", "grpc.health.v1.Health"):
            assert (await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=2)).status == SERVING
    assert len(health._conditions) == before


def test_a_taken_port_is_a_one_line_error_and_exit_code_1() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "tokenmesh", "router", "--port", str(port), "--workers", "w:1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        f"tokenmesh router: error: cannot listen on 127.0.0.1:{port} (in use or not permitted); "
        "choose another --port (0 picks a free one)"
    )
    assert "Traceback" not in done.stderr


# -- async with, and the gateway on the same lifecycle --------------------------------------------------------


class _Loops(Lifecycle):
    """A lifecycle with no server at all: one background loop that raises once told to."""

    def __init__(self) -> None:
        super().__init__(drain_grace_s=0, stop_grace_s=0)
        self.ready = False
        self.closed = False
        self.die = asyncio.Event()

    async def _start(self) -> None:
        self.spawn(self._loop(), "loop")
        self.ready = True

    async def _loop(self) -> None:
        await self.die.wait()
        raise RuntimeError("loop bug")

    async def _set_ready(self, ready: bool) -> None:
        self.ready = ready

    async def _close(self) -> None:
        self.closed = True


async def test_async_with_cancels_its_body_and_raises_the_failure_of_a_task_that_died(
    mesh: InProcessMesh,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pushed = asyncio.Event()

    async def broken_push(self: Prober, link: Link) -> None:
        await pushed.wait()
        raise RuntimeError("push loop bug")

    monkeypatch.setattr(Prober, "_push", broken_push)
    prober = Prober(
        ProberConfig(
            port=0,
            workers=tuple(w.host.address for w in mesh.workers),
            routers=(mesh.router.host.address,),
            interval_s=0.05,
        )
    )
    reached = False
    with pytest.raises(RuntimeError, match="push loop bug"):
        async with prober:
            assert prober.host.health.status("readiness") == SERVING
            pushed.set()
            await asyncio.sleep(10)  # cancelled when the push loop dies
            reached = True
    assert not reached
    assert prober.host.health.status("readiness") == NOT_SERVING
    assert prober.host.health.status("liveness") == NOT_SERVING  # stopped, not only drained
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0  # the cancel of the body was taken back


async def test_async_with_raises_the_failure_even_when_its_body_swallowed_the_cancel() -> None:
    loops = _Loops()
    with pytest.raises(RuntimeError, match="loop bug"):
        async with loops:
            assert loops.ready
            loops.die.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(10)
    assert not loops.ready and loops.closed
    assert isinstance(loops.failure, RuntimeError)


async def test_an_exception_of_the_body_itself_wins_over_a_later_failure() -> None:
    loops = _Loops()
    with pytest.raises(ValueError, match="the body's own"):
        async with loops:
            raise ValueError("the body's own")
    assert loops.failure is None and loops.closed


async def test_a_task_that_dies_while_the_service_starts_fails_the_start() -> None:
    class DiesAtOnce(_Loops):
        async def _start(self) -> None:
            self.die.set()
            await super()._start()
            await asyncio.sleep(0.05)  # the loop dies meanwhile

    loops = DiesAtOnce()
    with pytest.raises(RuntimeError, match="loop bug"):
        await loops.start()
    assert loops.closed and not loops.ready
    assert await DiesAtOnce().run() == 1  # and run() says so with its exit code


def _gateway_tls(folder: Path) -> dict[str, str]:
    return {
        "tls_mode": "tls",
        "tls_cert": str(folder / "gateway.crt"),
        "tls_key": str(folder / "gateway.key"),
        "tls_ca": str(folder / "ca.crt"),
    }


async def test_a_dying_certificate_task_stops_the_gateway_with_exit_code_1(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tokenmesh import tls
    from tokenmesh.certs import make_dev_certs
    from tokenmesh.client import Client
    from tokenmesh_gateway import Gateway, GatewayConfig

    def broken_renew(self: Client, credentials: grpc.ChannelCredentials) -> None:
        raise RuntimeError("renewal bug")

    monkeypatch.setattr(tls, "RENEWAL_POLL_S", 0.05)
    monkeypatch.setattr(Client, "renew", broken_renew)
    folder = make_dev_certs(tmp_path / "certs")
    gateway = Gateway(GatewayConfig(port=0, routers=(_closed_port(),), **_gateway_tls(folder)))
    run = asyncio.create_task(gateway.run())
    try:
        verify = ssl.create_default_context(cafile=str(folder / "ca.crt"))
        async with httpx.AsyncClient(verify=verify) as http:
            await wait_until(lambda: gateway.port != 0 and gateway.app is not None)
            health = f"https://127.0.0.1:{gateway.port}/health"
            assert (await http.get(health)).status_code == 200
            await asyncio.sleep(0.2)  # the renewal loop has read the files as they are
            cert = folder / "gateway.crt"
            cert.write_bytes(cert.read_bytes() + b"\n")  # renewed: the loop renews the channels, which raises
            assert await asyncio.wait_for(run, 10) == 1
            assert isinstance(gateway.failure, RuntimeError) and "renewal bug" in str(gateway.failure)
            assert gateway.app is not None and gateway.app.front.draining
            with pytest.raises(httpx.ConnectError):
                await http.get(health)  # stopped, not half-alive
    finally:
        await gateway.shutdown()
        run.cancel()


async def test_the_gateway_starts_once_and_a_second_shutdown_waits_for_the_first() -> None:
    from tokenmesh_gateway import Gateway, GatewayConfig

    gateway = Gateway(GatewayConfig(port=0, routers=(_closed_port(),), drain_grace_s=0.2))
    async with gateway:
        with pytest.raises(RuntimeError, match="gateway was started already"):
            await gateway.start()
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"http://{gateway.address}/health")).status_code == 200
            first = asyncio.create_task(gateway.shutdown())
            second = asyncio.create_task(gateway.shutdown())
            await asyncio.sleep(0)
            await second
            assert first.done() or await asyncio.wait_for(first, 1) is None
            with pytest.raises(httpx.ConnectError):  # the second returned once the first had stopped the server
                await http.get(f"http://{gateway.address}/health")
    await gateway.shutdown()
    assert gateway.failure is None
    with pytest.raises(RuntimeError, match="started already"):
        await gateway.start()
