"""Prometheus metrics, scraped over HTTP from real services (in-process mesh over FakeBackend)."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.dns_server import free_port_on
from tests.support.mesh import InProcessMesh, collect, in_process_mesh, wait_until
from tokenmesh.prober import Prober, ProberConfig
from tokenmesh.v1 import inference_pb2


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of http://127.0.0.1:port/metrics: (name, sorted labels) -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()  # noqa: S310
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


DOC = (Path(__file__).resolve().parents[2] / "docs" / "observability.md").read_text()


def undocumented(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> set[str]:
    """Metric names seen in a scrape that the metrics table of docs/observability.md does not name."""
    names = {re.sub(r"_(count|sum|bucket|created)$", "", n) for n, _ in samples}
    return {n for n in names if f"`{n}`" not in DOC and f"`{n.removesuffix('_total')}_total`" not in DOC}


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and all((k, v2) in ls for k, v2 in labels.items()))


async def test_the_router_counts_what_callers_feel_and_reads_the_pool_at_scrape_time() -> None:
    port = free_port_on("127.0.0.1")
    async with in_process_mesh(metrics_port=port, metrics_tenants=("acme",)) as mesh:
        mesh.backends[0].fail_after = 4  # every generation that starts there moves to the other worker
        finals = []
        for i in range(4):
            request = inference_pb2.GenerateRequest(prompt=f"p{i}", max_tokens=8)
            request.labels["tenant"] = "acme" if i < 2 else "evil-" + "x" * 200  # not on the list: "other"
            finals.append([c async for c in mesh.inference.Generate(request)][-1])
        for bad in (
            inference_pb2.GenerateRequest(prompt="p", model="nope"),
            inference_pb2.GenerateRequest(prompt="p", labels={"tenant": "\x00" + "y" * 100_000}),
        ):
            try:
                [c async for c in mesh.inference.Generate(bad)]
            except grpc.aio.AioRpcError as exc:
                assert exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)
            else:
                raise AssertionError("a bad request was served")
        samples = await asyncio.to_thread(scrape, port)

    model = mesh.backends[0].models()[0].name
    assert [f.finish_reason for f in finals] == [inference_pb2.FINISH_REASON_LENGTH] * 4
    assert total(samples, "tokenmesh_router_requests_total", outcome="length") == 4
    assert total(samples, "tokenmesh_router_requests_total", outcome="length", tenant="acme") == 2
    assert total(samples, "tokenmesh_router_requests_total", outcome="length", tenant="other") == 2
    assert not any("evil" in v for (_, ls) in samples for _, v in ls)  # the caller's label never became one
    assert total(samples, "tokenmesh_router_requests_total", outcome="not_found", model="") == 1
    assert total(samples, "tokenmesh_router_requests_total", outcome="invalid_argument", tenant="other") == 1
    assert not any("y" * 100 in v or "\x00" in v for (_, ls) in samples for _, v in ls)
    assert total(samples, "tokenmesh_router_time_to_first_token_seconds_count", model=model) == 4
    assert total(samples, "tokenmesh_router_generation_tokens_total", model=model) == 32
    assert total(samples, "tokenmesh_router_request_duration_seconds_count", outcome="length") == 4
    moved = sum(f.migrations for f in finals)
    assert moved >= 1
    assert total(samples, "tokenmesh_router_migrations_total", reason="backend") == moved
    first = mesh.workers[0].host.address
    assert total(samples, "tokenmesh_router_worker_failures_total", worker=first, reason="backend") == moved
    assert total(samples, "tokenmesh_router_interruptions_total") == 0  # every stream ended whole
    # Read from the pool at scrape time: both workers, nothing in flight, nothing queued.
    assert {dict(ls)["worker"] for (n, ls) in samples if n == "tokenmesh_router_in_flight"} == {
        w.host.address for w in mesh.workers
    }
    assert total(samples, "tokenmesh_router_in_flight") == 0
    assert total(samples, "tokenmesh_router_queued") == 0
    assert total(samples, "tokenmesh_router_worker_state", worker=first, state="serving") == 1
    assert not undocumented(samples)


async def test_the_router_says_how_each_worker_is_reached_and_how_many_chunks_each_link_message_held() -> None:
    for worker_link in ("auto", "off"):
        port = free_port_on("127.0.0.1")
        async with in_process_mesh(metrics_port=port, worker_link=worker_link) as mesh:
            runs = await asyncio.gather(*(collect(mesh, prompt=f"p{i}", max_tokens=10 + i) for i in range(24)))
            samples = await asyncio.to_thread(scrape, port)
        mode = "batched" if worker_link == "auto" else "per-generation"
        for w in mesh.workers:
            assert total(samples, "tokenmesh_router_worker_link", worker=w.host.address, link=mode) == 1
            assert total(samples, "tokenmesh_router_worker_link", worker=w.host.address) == 1  # one mode each
        messages = total(samples, "tokenmesh_router_link_messages_total")
        chunks = total(samples, "tokenmesh_router_link_chunks_total")
        if worker_link == "off":
            assert messages == chunks == 0
            continue
        # Every chunk but the final one (an end on the link) came in a link message, some several to a message.
        assert chunks == sum(len(c) - 1 for c in runs)
        assert 0 < messages <= chunks + len(runs)
        assert all(total(samples, "tokenmesh_router_link_messages_total", worker=w.host.address) for w in mesh.workers)
        assert not undocumented(samples)


def parse(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }


async def test_workers_count_outcomes_and_failures_by_class() -> None:
    async with in_process_mesh() as mesh:
        for worker in mesh.workers:  # as --metrics-port does (both cannot listen on one port here)
            worker.servicer.metrics.enabled = True
        mesh.backends[0].fail_after = 4
        finals = [
            [c async for c in mesh.inference.Generate(inference_pb2.GenerateRequest(prompt=f"p{i}", max_tokens=8))][-1]
            for i in range(4)
        ]
        first, second = (parse(w.servicer.metrics.registry) for w in mesh.workers)
    moved = sum(f.migrations for f in finals)
    assert moved >= 1
    assert total(first, "tokenmesh_worker_failures_total", error_class="backend") == moved
    assert total(first, "tokenmesh_worker_generations_total", outcome="backend") == moved
    assert (
        total(first, "tokenmesh_worker_generations_total", outcome="length")
        + total(second, "tokenmesh_worker_generations_total", outcome="length")
        == 4
    )
    assert total(second, "tokenmesh_worker_failures_total") == 0
    started = sum(len(b.started) for b in mesh.backends)  # every generation's first token was timed
    assert started == 4 + moved
    assert (
        total(first, "tokenmesh_worker_engine_time_to_first_token_seconds_count")
        + total(second, "tokenmesh_worker_engine_time_to_first_token_seconds_count")
        == started
    )
    assert total(first, "tokenmesh_worker_in_flight") == 0 and total(first, "tokenmesh_worker_serving") == 1
    assert not undocumented(first)


async def test_the_prober_reports_weights_and_what_each_router_acked() -> None:
    port = free_port_on("127.0.0.1")
    async with in_process_mesh() as mesh:
        workers = tuple(w.host.address for w in mesh.workers)
        prober = Prober(
            ProberConfig(
                port=0, workers=workers, routers=(mesh.router.host.address,), metrics_port=port, interval_s=0.1
            )
        )
        await prober.start()
        try:
            await wait_until(
                lambda: (
                    prober.table.version > 0
                    and all(link.acked_version == prober.table.version for link in prober.routers.values())
                    and all(w.weight > 0 for w in prober.table.workers)
                )
            )
            samples = await asyncio.to_thread(scrape, port)
            version = prober.table.version
        finally:
            await prober.shutdown()
    assert {dict(ls)["worker"] for (n, ls) in samples if n == "tokenmesh_prober_worker_up"} == set(workers)
    assert total(samples, "tokenmesh_prober_worker_up") == 2
    assert total(samples, "tokenmesh_prober_router_acked_version", router=mesh.router.host.address) >= version - 5
    assert total(samples, "tokenmesh_prober_router_connected") == 1
    assert total(samples, "tokenmesh_prober_weight_tables_total") >= 1
    assert not undocumented(samples)


async def test_with_metrics_off_a_generation_records_nothing(mesh: InProcessMesh) -> None:
    [c async for c in mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="p", max_tokens=3))]
    samples = parse(mesh.router.metrics.registry)
    assert not mesh.router.metrics.enabled and mesh.router.metrics_endpoint is None
    assert total(samples, "tokenmesh_router_requests_total") == 0
    assert total(samples, "tokenmesh_router_in_flight") == 0  # the state gauges still answer
    assert {dict(ls)["worker"] for (n, ls) in samples if n == "tokenmesh_router_in_flight"} == {
        w.host.address for w in mesh.workers
    }
