"""TLS and mutual TLS: every bad certificate refused, identities checked per RPC group, rotation under live streams."""

from __future__ import annotations

import asyncio
import datetime
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from tests.support.fakes import FakeBackend
from tests.support.mesh import assert_exact, wait_until
from tokenmesh.certs import issue, make_ca, make_dev_certs
from tokenmesh.config import ConfigError
from tokenmesh.router import Router, RouterConfig
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, router_pb2, router_pb2_grpc
from tokenmesh.worker import Worker, WorkerConfig


def load_ca(folder: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA make_dev_certs wrote in folder, to sign more certificates with (renewals, other identities)."""
    cert = x509.load_pem_x509_certificate((folder / "ca.crt").read_bytes())
    key = serialization.load_pem_private_key((folder / "ca.key").read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return cert, key


def tls_flags(folder: Path, role: str, mode: str = "mtls") -> dict[str, str]:
    return {
        "tls_mode": mode,
        "tls_cert": str(folder / f"{role}.crt"),
        "tls_key": str(folder / f"{role}.key"),
        "tls_ca": str(folder / "ca.crt"),
    }


def credentials(folder: Path, stem: str = "client", ca: Path | None = None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        (ca or folder / "ca.crt").read_bytes(),
        (folder / f"{stem}.key").read_bytes(),
        (folder / f"{stem}.crt").read_bytes(),
    )


class TlsMesh:
    def __init__(self, folder: Path, router: Router, workers: list[Worker], backends: list[FakeBackend]) -> None:
        self.folder, self.router, self.workers, self.backends = folder, router, workers, backends

    def channel(self, stem: str = "client", ca: Path | None = None) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(self.router.host.address, credentials(self.folder, stem, ca))


@pytest.fixture
async def mesh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[TlsMesh]:
    from tokenmesh import tls

    monkeypatch.setattr(tls, "RENEWAL_POLL_S", 0.1)  # every service here looks for renewed files often
    folder = make_dev_certs(tmp_path / "certs")
    backends = [FakeBackend(delay=0.01), FakeBackend(delay=0.01)]
    workers = [
        Worker(WorkerConfig(port=0, drain_grace_s=0.5, **tls_flags(folder, "worker")), backend=b) for b in backends
    ]
    router: Router | None = None
    try:
        for worker in workers:
            await worker.start()
        router = Router(
            RouterConfig(
                port=0,
                workers=tuple(w.host.address for w in workers),
                drain_grace_s=0.5,
                metrics_port=0,
                **tls_flags(folder, "router"),
            )
        )
        await router.start()
        pool = router.pool
        await wait_until(lambda: all(e.healthy and e.models for e in pool.entries.values()))
        yield TlsMesh(folder, router, workers, backends)
    finally:
        if router is not None:
            await router.shutdown()
        for worker in workers:
            await worker.shutdown()


async def generate(channel: grpc.aio.Channel, tokens: int = 4) -> list[inference_pb2.GenerateChunk]:
    stub = inference_pb2_grpc.InferenceStub(channel)
    return [c async for c in stub.Generate(inference_pb2.GenerateRequest(prompt="hi", max_tokens=tokens), timeout=10)]


async def test_mutual_tls_end_to_end_and_every_bad_peer_refused(mesh: TlsMesh, tmp_path: Path) -> None:
    async with mesh.channel() as channel:  # client certificate from the CA: served (router -> worker over mTLS too)
        chunks = await generate(channel)
        assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
    refused = []
    async with grpc.aio.insecure_channel(mesh.router.host.address) as plaintext:
        refused.append(plaintext)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(plaintext)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # No client certificate at all.
    no_cert = grpc.ssl_channel_credentials((mesh.folder / "ca.crt").read_bytes())
    async with grpc.aio.secure_channel(mesh.router.host.address, no_cert) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(channel)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # A certificate from another CA.
    other = make_dev_certs(tmp_path / "other")
    async with grpc.aio.secure_channel(
        mesh.router.host.address, credentials(other, ca=mesh.folder / "ca.crt")
    ) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(channel)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # An expired certificate from the right CA.
    ca = load_ca(mesh.folder)
    issue(
        mesh.folder,
        "client",
        ca,
        name="expired",
        days=1,
        not_before=datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=3),
    )
    async with mesh.channel("expired") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(channel)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # The mesh is untouched by all of it.
    async with mesh.channel() as channel:
        assert (await generate(channel))[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH


@pytest.mark.parametrize("identity", ["client", "gateway"])
async def test_generate_stream_is_an_inference_call_any_identity_of_the_ca_may_make(
    mesh: TlsMesh, identity: str
) -> None:
    async with mesh.channel(identity) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).GenerateStream(timeout=10)
        assert (await call.read()).HasField("settings")
        start = inference_pb2.GenerateRequest(prompt="hi", max_tokens=4)
        await call.write(inference_pb2.StreamCommands(commands=[inference_pb2.StreamCommand(stream=1, generate=start)]))
        await call.done_writing()
        chunks = []
        while (message := await call.read()) is not grpc.aio.EOF:
            chunks += message.chunks
    assert_exact(chunks, 4)


@pytest.mark.parametrize("identity", ["client", "worker", "gateway", "router"])
async def test_push_weights_from_an_identity_that_may_not_is_permission_denied(mesh: TlsMesh, identity: str) -> None:
    before = mesh.router.pool.version
    async with mesh.channel(identity) as channel:
        call = router_pb2_grpc.ControlStub(channel).PushWeights()
        await call.write(router_pb2.WeightTable(version=10**15))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert f"identity spiffe://tokenmesh/{identity} may not call /tokenmesh.v1.Control/PushWeights" in (
        info.value.details() or ""
    )
    assert mesh.router.pool.version == before  # no weight changed (a one-process router has no sibling routers)
    denied = mesh.router.metrics.denied.labels("Control")._value.get()  # noqa: SLF001 - the counter's value
    assert denied == 1


async def test_a_worker_refuses_a_client_identity_and_takes_the_router(mesh: TlsMesh) -> None:
    from tokenmesh.v1 import worker_pb2, worker_pb2_grpc

    address = mesh.workers[0].host.address
    for stem, code in (("client", grpc.StatusCode.PERMISSION_DENIED), ("router", None)):
        async with grpc.aio.secure_channel(address, credentials(mesh.folder, stem)) as channel:
            call = worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=5)
            if code is None:
                assert (await call).models
                continue
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == code and "spiffe://tokenmesh/client" in (info.value.details() or "")


def served_serial(address: str, folder: Path) -> int:
    """The serial number of the certificate the server presents to a new connection."""
    host, port = address.rsplit(":", 1)
    context = ssl.create_default_context(cafile=str(folder / "ca.crt"))
    context.load_cert_chain(str(folder / "client.crt"), str(folder / "client.key"))
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection((host, int(port)), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname=host) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


async def test_renewed_certificates_reach_new_connections_and_live_streams_go_on(mesh: TlsMesh) -> None:
    address = mesh.router.host.address
    first = await asyncio.to_thread(served_serial, address, mesh.folder)
    async with mesh.channel() as channel:
        stream = inference_pb2_grpc.InferenceStub(channel).Generate(
            inference_pb2.GenerateRequest(prompt="long", max_tokens=100), timeout=30
        )
        seqs = [(await stream.read()).seq]
        # Taken before the files change: the router looks every 0.1 s here, so it may renew while the check
        # below connects (CI saw the channels taken after the renewal, and waited for one more).
        before = {a: link.channel for a, link in mesh.router.links.items()}
        watches = {a: link.tasks["health watch"] for a, link in mesh.router.links.items()}
        # cert-manager renews in place: same CA, new key and certificate, for router and workers alike.
        ca = load_ca(mesh.folder)
        for role in ("router", "worker"):
            issue(mesh.folder, role, ca)
        renewed = await asyncio.to_thread(served_serial, address, mesh.folder)
        assert renewed != first
        await wait_until(lambda: all(mesh.router.links[a].channel is not c for a, c in before.items()), timeout=5)
        # Each worker's health watch started again on its new channel; the stream above runs on on its old one.
        await wait_until(lambda: all(t.done() for t in watches.values()))
        assert all(t.cancelled() and mesh.router.links[a].tasks["health watch"] is not t for a, t in watches.items())
        assert renewed == x509.load_pem_x509_certificate((mesh.folder / "router.crt").read_bytes()).serial_number
        while (chunk := await stream.read()) is not grpc.aio.EOF:
            seqs.append(chunk.seq)
            final = chunk
    assert final.finish_reason == inference_pb2.FINISH_REASON_LENGTH and final.usage.completion_tokens == 100
    assert seqs == list(range(1, len(seqs) + 1))
    async with mesh.channel() as channel:  # and new calls work over the renewed certificates end to end
        assert (await generate(channel))[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH


def test_bad_certificate_settings_name_the_file(tmp_path: Path) -> None:
    folder = make_dev_certs(tmp_path / "certs")
    good = tls_flags(folder, "router")
    with pytest.raises(ConfigError, match=r"--tls-key .*missing.key: cannot read it"):
        RouterConfig(workers=("a:1",), **{**good, "tls_key": str(tmp_path / "missing.key")})
    with pytest.raises(ConfigError, match=r"--tls-key .*worker.key is not the key of --tls-cert .*router.crt"):
        RouterConfig(workers=("a:1",), **{**good, "tls_key": str(folder / "worker.key")})
    (tmp_path / "junk.crt").write_text("not a certificate")
    with pytest.raises(ConfigError, match=r"--tls-cert .*junk.crt: not a PEM file"):
        RouterConfig(workers=("a:1",), **{**good, "tls_cert": str(tmp_path / "junk.crt")})
    with pytest.raises(ConfigError, match="--tls-mode mtls needs --tls-ca"):
        RouterConfig(workers=("a:1",), **{**good, "tls_ca": ""})
    with pytest.raises(ConfigError, match="tls_mode must be one of off, tls, mtls"):
        RouterConfig(workers=("a:1",), tls_mode="ssl")
    make_ca(tmp_path / "ca-only")  # a CA alone makes no service certificate
    assert not (tmp_path / "ca-only" / "router.crt").exists()


def test_a_bad_key_file_at_start_is_one_line_naming_it_and_exit_2(tmp_path: Path) -> None:
    import subprocess
    import sys

    folder = make_dev_certs(tmp_path / "certs")
    missing = tmp_path / "gone.key"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmesh",
            "router",
            "--workers",
            "127.0.0.1:1",
            "--tls-mode",
            "mtls",
            "--tls-cert",
            str(folder / "router.crt"),
            "--tls-key",
            str(missing),
            "--tls-ca",
            str(folder / "ca.crt"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"tokenmesh router: error: --tls-key {missing}: cannot read it (No such file or directory)"
    ]


async def test_the_prober_reconnects_with_renewed_certificates_and_its_tables_keep_reaching_the_router(
    mesh: TlsMesh,
) -> None:
    from tokenmesh.prober import Prober, ProberConfig

    prober = Prober(
        ProberConfig(
            port=0,
            workers=tuple(w.host.address for w in mesh.workers),
            routers=(mesh.router.host.address,),
            interval_s=0.1,
            **tls_flags(mesh.folder, "prober"),
        )
    )
    await prober.start()
    try:
        await wait_until(
            lambda: (
                prober.table.version > 0
                and mesh.router.pool.version == prober.table.version
                and all(w.weight > 0 for w in prober.table.workers)
            ),
            timeout=10,
        )
        links = (prober.worker_links, prober.router_links)
        before = {(i, a): link.channel for i, each in enumerate(links) for a, link in each.items()}
        assert len(before) == len(mesh.workers) + 1
        issue(mesh.folder, "prober", load_ca(mesh.folder))
        await wait_until(lambda: all(links[i][a].channel is not c for (i, a), c in before.items()), timeout=5)
        await wait_until(lambda: all(link.connected for link in prober.routers.values()), timeout=5)
        # Workers stay weighed (no table dropped them while reconnecting), and the router has the latest table.
        assert all(w.weight > 0 for w in prober.table.workers)
        await wait_until(lambda: mesh.router.pool.version == prober.table.version, timeout=5)
        assert prober.failure is None
    finally:
        await prober.shutdown()


async def served_certificate(port: int, context: ssl.SSLContext) -> bytes:
    """The certificate (DER) a new TLS connection to 127.0.0.1:port is served."""
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname="localhost")
    try:
        served = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.close()
    assert served is not None
    return bytes(served)


def certificate_der(path: Path) -> bytes:
    return x509.load_pem_x509_certificate(path.read_bytes()).public_bytes(serialization.Encoding.DER)


async def test_the_gateway_renews_its_https_certificate_and_its_channels_to_the_routers(mesh: TlsMesh) -> None:
    import httpx

    from tokenmesh_gateway import Gateway, GatewayConfig

    gateway = Gateway(GatewayConfig(port=0, routers=(mesh.router.host.address,), **tls_flags(mesh.folder, "gateway")))
    await gateway.start()
    try:
        with_cert = ssl.create_default_context(cafile=str(mesh.folder / "ca.crt"))
        with_cert.load_cert_chain(str(mesh.folder / "client.crt"), str(mesh.folder / "client.key"))
        first = certificate_der(mesh.folder / "gateway.crt")
        assert await served_certificate(gateway.port, with_cert) == first
        async with httpx.AsyncClient(verify=with_cert) as http:
            body = {"prompt": "hi", "max_tokens": 3}
            assert (await http.post(f"{gateway.url}/completions", json=body)).status_code == 200
            assert gateway.client is not None
            links = gateway.client._links  # noqa: SLF001 - its channels to the routers
            before = {a: link.channel for a, link in links.items()}
            assert list(before) == [mesh.router.host.address]
            issue(mesh.folder, "gateway", load_ca(mesh.folder))
            renewed = certificate_der(mesh.folder / "gateway.crt")
            assert renewed != first
            await wait_until(lambda: all(links[a].channel is not c for a, c in before.items()), timeout=5)
            # New HTTPS connections get the renewed certificate (within a poll or two: the files may be read
            # between the writes of the certificate and its key); the client's open connection goes on.
            for _ in range(50):
                if await served_certificate(gateway.port, with_cert) == renewed:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("new HTTPS connections still get the certificate of before the renewal")
            assert (await http.post(f"{gateway.url}/completions", json=body)).status_code == 200
        without = ssl.create_default_context(cafile=str(mesh.folder / "ca.crt"))
        async with httpx.AsyncClient(verify=without) as http:  # no client certificate: refused
            with pytest.raises(httpx.HTTPError):
                await http.post(f"{gateway.url}/completions", json={"prompt": "hi", "max_tokens": 3})
    finally:
        await gateway.shutdown()
