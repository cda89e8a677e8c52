"""--discovery dns: the lookup rules, the resolver against a real DNS server, and a router that follows the records."""

from __future__ import annotations

import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.dns_server import DnsServer, free_port_on
from tests.support.fakes import FakeBackend
from tests.support.mesh import wait_until
from tokenmesh.config import ConfigError
from tokenmesh.discovery import EMPTY_ROUNDS, Discovery, DnsResolver, LookupFailed
from tokenmesh.prober import ProberConfig
from tokenmesh.router import Router, RouterConfig
from tokenmesh.router._spares import SPARE
from tokenmesh.router._transport import LINK
from tokenmesh.server import ServiceHost
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, router_pb2, router_pb2_grpc
from tokenmesh.worker import Worker, WorkerConfig

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class Records:
    """A resolve function over a dict: host -> IPs, or an exception to raise."""

    def __init__(self) -> None:
        self.answers: dict[str, list[str] | Exception] = {}

    async def __call__(self, host: str) -> list[str]:
        answer = self.answers.get(host, [])
        if isinstance(answer, Exception):
            raise answer
        return list(answer)


def discovery(records: Records, *names: str) -> tuple[Discovery, list[tuple[str, str]]]:
    events: list[tuple[str, str]] = []
    found = Discovery(
        names,
        records,
        lambda a, n: events.append(("add", a)),
        lambda a, why: events.append(("remove", a)),
        what="worker",
    )
    return found, events


async def test_addresses_appear_at_once_and_one_missing_from_an_answer_goes_at_once() -> None:
    records = Records()
    records.answers["w.svc"] = ["10.0.0.1", "10.0.0.2"]
    found, events = discovery(records, "w.svc:50061")
    await found.refresh()
    assert events == [("add", "10.0.0.1:50061"), ("add", "10.0.0.2:50061")]
    records.answers["w.svc"] = ["10.0.0.2", "10.0.0.3"]
    await found.refresh()
    assert events[2:] == [("add", "10.0.0.3:50061"), ("remove", "10.0.0.1:50061")]
    assert set(found.found) == {"10.0.0.2:50061", "10.0.0.3:50061"}
    assert found.found["10.0.0.3:50061"] == {"w.svc:50061"}


async def test_an_empty_answer_drains_nothing_until_the_name_stayed_empty_for_two_intervals() -> None:
    records = Records()
    records.answers["w.svc"] = ["10.0.0.1"]
    found, events = discovery(records, "w.svc:50061")
    await found.refresh()
    records.answers["w.svc"] = []  # NXDOMAIN or no records: every pod gone, or a hiccup
    for _ in range(EMPTY_ROUNDS - 1):
        await found.refresh()
    assert events == [("add", "10.0.0.1:50061")]
    records.answers["w.svc"] = ["10.0.0.1"]  # it was a hiccup: the count starts again
    await found.refresh()
    records.answers["w.svc"] = []
    for _ in range(EMPTY_ROUNDS - 1):
        await found.refresh()
    assert events == [("add", "10.0.0.1:50061")]
    await found.refresh()  # the third empty answer in a row: two intervals empty
    assert events == [("add", "10.0.0.1:50061"), ("remove", "10.0.0.1:50061")]


async def test_a_failed_lookup_keeps_everything_and_is_retried(caplog: pytest.LogCaptureFixture) -> None:
    records = Records()
    records.answers["w.svc"] = ["10.0.0.1"]
    found, events = discovery(records, "w.svc:50061")
    await found.refresh()
    records.answers["w.svc"] = LookupFailed("Timeout: no answer in 2 s")
    for _ in range(EMPTY_ROUNDS + 2):
        await found.refresh()
    assert events == [("add", "10.0.0.1:50061")]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings  # said once, not every round
    assert "w.svc:50061 lookup failed (Timeout: no answer in 2 s); keeping its 1 worker(s)" in warnings[0]
    records.answers["w.svc"] = ["10.0.0.2"]
    await found.refresh()
    assert events[1:] == [("add", "10.0.0.2:50061"), ("remove", "10.0.0.1:50061")]


async def test_an_address_two_names_share_stays_while_either_has_it_and_ip_names_need_no_lookup() -> None:
    records = Records()
    records.answers["a.svc"] = ["10.0.0.1"]
    records.answers["b.svc"] = ["10.0.0.1"]
    found, events = discovery(records, "a.svc:1", "b.svc:1", "10.9.9.9:1", "[fd00::1]:1")
    await found.refresh()
    assert sorted(events) == [("add", "10.0.0.1:1"), ("add", "10.9.9.9:1"), ("add", "[fd00::1]:1")]
    records.answers["a.svc"] = ["10.0.0.2"]
    await found.refresh()
    assert ("remove", "10.0.0.1:1") not in events
    records.answers["b.svc"] = ["10.0.0.2"]
    await found.refresh()
    assert events[-1] == ("remove", "10.0.0.1:1")


async def test_the_resolver_reads_a_real_dns_server() -> None:
    server = DnsServer().start()
    try:
        server.zone.set("workers.mesh.test", "127.0.0.2", "127.0.0.3")
        server.zone.set("v6.mesh.test", "::1")
        server.zone.set("empty.mesh.test")
        resolve = DnsResolver(server.address)
        assert sorted(await resolve("workers.mesh.test")) == ["127.0.0.2", "127.0.0.3"]
        assert await resolve("v6.mesh.test") == ["::1"]
        assert await resolve("empty.mesh.test") == []
        assert await resolve("missing.mesh.test") == []  # NXDOMAIN
    finally:
        server.stop()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:  # bound, never answers
        silent.bind(("127.0.0.1", 0))
        host, port = silent.getsockname()
        with pytest.raises(LookupFailed):
            await DnsResolver(f"{host}:{port}", timeout_s=0.3)("workers.mesh.test")


def test_discovery_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="discovery_interval_s must be in"):
        RouterConfig(workers=("w.svc:1",), discovery="dns", discovery_interval_s=0)
    with pytest.raises(ConfigError, match="the host must be an IP address, not a name"):
        RouterConfig(workers=("w.svc:1",), discovery="dns", discovery_dns_server="kube-dns:53")
    with pytest.raises(ConfigError, match="discovery must be static or dns, got 'prober'"):
        ProberConfig(workers=("w.svc:1",), discovery="prober")
    with pytest.raises(ConfigError, match="health_port must differ from port"):
        RouterConfig(workers=("w:1",), port=9000, health_port=9000)


@pytest.mark.parametrize("worker_link", ["auto", "off"])
async def test_a_router_follows_the_records_and_drains_a_worker_that_left_without_breaking_its_stream(
    worker_link: str,
) -> None:
    server = DnsServer().start()
    hosts = ("127.0.0.1", "127.0.0.2")
    port = free_port_on(*hosts)
    backends = [FakeBackend(delay=0.01), FakeBackend(delay=0.01)]
    workers = [
        Worker(WorkerConfig(host=h, port=port, drain_grace_s=1), backend=b)
        for h, b in zip(hosts, backends, strict=True)
    ]
    router: Router | None = None
    try:
        for worker in workers:
            await worker.start()
        server.zone.set("workers.mesh.test", "127.0.0.1")
        router = Router(
            RouterConfig(
                port=0,
                workers=(f"workers.mesh.test:{port}", f"missing.mesh.test:{port}"),
                discovery="dns",
                discovery_dns_server=server.address,
                discovery_interval_s=0.2,
                drain_grace_s=1,
                worker_link=worker_link,
            )
        )
        await router.start()
        pool = router.pool
        first, second = f"127.0.0.1:{port}", f"127.0.0.2:{port}"
        await wait_until(lambda: first in pool.entries and pool.entries[first].healthy)
        async with grpc.aio.insecure_channel(router.host.address) as channel:
            inference = inference_pb2_grpc.InferenceStub(channel)
            operator = router_pb2_grpc.RouterStub(channel)
            # A long stream on the first worker (the only one), then the records change under it.
            stream = inference.Generate(inference_pb2.GenerateRequest(prompt="long", max_tokens=150))
            seqs = [(await stream.read()).seq]
            first_link = router.links[first]
            watch = first_link.tasks["health watch"]
            # Per generation, a spare call is opened for its next generation once this one started; on the link,
            # its session is the worker's link task's.
            spare = first_link.held(SPARE)
            link_task = first_link.tasks.get(LINK)
            if worker_link == "off":
                assert spare is not None and not spare.done() and link_task is None
            else:
                assert spare is None and link_task is not None and not link_task.done()
            server.zone.set("workers.mesh.test", "127.0.0.2")
            await wait_until(lambda: second in pool.entries and pool.entries[second].healthy, timeout=2)
            table = await operator.GetRoutingTable(router_pb2.GetRoutingTableRequest())
            rows = {w.address: w for w in table.workers}
            assert rows[second].found_by == f"dns workers.mesh.test:{port}"
            assert rows[first].reason.startswith(f"draining: gone from DNS name workers.mesh.test:{port}")
            assert rows[first].weight == 0 and rows[first].in_flight == 1
            # New work goes to the worker that is listed; the old one's stream runs to its end.
            before = [len(b.started) for b in backends]
            other = [c async for c in inference.Generate(inference_pb2.GenerateRequest(prompt="new", max_tokens=3))]
            assert other[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
            assert [len(b.started) for b in backends] == [before[0], before[1] + 1]
            while (chunk := await stream.read()) is not grpc.aio.EOF:
                seqs.append(chunk.seq)
                final = chunk
            assert final.finish_reason == inference_pb2.FINISH_REASON_LENGTH
            assert final.usage.completion_tokens == 150 and seqs == list(range(1, len(seqs) + 1))
            # Its streams ended: the first worker is dropped, channel and all.
            await wait_until(lambda: first not in pool.entries, timeout=2)
            assert first not in router.links and first_link.tasks == {}
            if spare is not None:
                assert spare.cancelled()
            else:  # its link task retires the session as it wakes from the cancel, a few loop turns later
                await wait_until(lambda: first not in router.transports.sessions, timeout=2)
            await wait_until(lambda: watch.done() and (link_task is None or link_task.done()))
            assert watch.cancelled() and (link_task is None or link_task.cancelled())
            table = await operator.GetRoutingTable(router_pb2.GetRoutingTableRequest())
            assert [w.address for w in table.workers] == [second]
            # And it comes back when the name lists it again.
            server.zone.set("workers.mesh.test", "127.0.0.1", "127.0.0.2")
            await wait_until(lambda: first in pool.entries and pool.entries[first].healthy, timeout=2)
            assert router.links[first] is not first_link  # a new link, with a new watch
        assert router.failure is None  # the name that never resolved was retried, not fatal
    finally:
        if router is not None:
            await router.shutdown()
        for worker in workers:
            await worker.shutdown()
        server.stop()


async def test_health_alone_answers_on_the_health_port() -> None:
    health_port = free_port_on("127.0.0.1")
    host = ServiceHost("127.0.0.1", 0, ["tokenmesh.v1.Inference"], health_port=health_port)
    inference_pb2_grpc.add_InferenceServicer_to_server(inference_pb2_grpc.InferenceServicer(), host.server)
    await host.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)

            async def status(name: str) -> int:
                return (await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)).status

            await host.set_ready(True)
            assert [await status(n) for n in ("", "liveness", "readiness")] == [SERVING] * 3
            with pytest.raises(grpc.aio.AioRpcError) as info:  # nothing but health on this port
                await inference_pb2_grpc.InferenceStub(channel).ListModels(inference_pb2.ListModelsRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
            await host.set_ready(False)  # what a drain does: liveness stays SERVING
            assert [await status(n) for n in ("", "liveness", "readiness")] == [NOT_SERVING, SERVING, NOT_SERVING]
    finally:
        await host.stop(0)
    with socket.socket() as probe:  # the health port is released with the server (TIME_WAIT aside)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", health_port))
        probe.listen()


async def test_a_taken_health_port_is_named() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        host = ServiceHost("127.0.0.1", 0, [], health_port=port)
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port} for health.*--health-port"):
            await host.start()
        await host.stop(0)


def test_a_worker_found_after_the_table_arrived_takes_its_weight_from_that_table() -> None:
    from tokenmesh.router._pool import WorkerPool

    pool = WorkerPool()
    pool.add("10.0.0.1:1", "dns w:1")
    table = router_pb2.WeightTable(
        version=7,
        workers=[
            router_pb2.WorkerWeight(
                address="10.0.0.1:1", weight=0.5, state=router_pb2.WORKER_STATE_SERVING, reason="a"
            ),
            router_pb2.WorkerWeight(
                address="10.0.0.2:1",
                weight=0.25,
                state=router_pb2.WORKER_STATE_SERVING,
                reason="b",
                concurrency_limit=8,
            ),
        ],
    )
    assert pool.apply(table)  # without adopt, the worker the router has not found is passed over
    assert set(pool.entries) == {"10.0.0.1:1"}
    late = pool.add("10.0.0.2:1", "dns w:1")  # the router's own lookup finds it later
    assert (late.weight, late.reason, late.limit) == (0.25, "b", 8)
    unknown = pool.add("10.0.0.3:1", "dns w:1")
    assert (unknown.weight, unknown.reason) == (0.0, "not in the prober's table")
    pool.let_go(late, "gone from DNS name w:1")
    assert pool.effective_weight(late) == 0
    row = {w.address: w for w in pool.table().workers}["10.0.0.2:1"]
    assert row.weight == 0 and row.reason.startswith("draining: gone from DNS name w:1")
    assert pool.add("10.0.0.2:1", "dns w:1") is late and not late.gone  # listed again: taken back
    pool.drop(unknown)
    assert set(pool.entries) == {"10.0.0.1:1", "10.0.0.2:1"}
