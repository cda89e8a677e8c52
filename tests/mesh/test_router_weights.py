"""Control/PushWeights: each table is checked whole before any of it is applied; discovery decides who may join."""

from __future__ import annotations

import math

import grpc
import pytest

from tests.support.mesh import InProcessMesh, in_process_mesh
from tokenmesh.config import ConfigError
from tokenmesh.router import RouterConfig
from tokenmesh.v1 import inference_pb2, router_pb2, router_pb2_grpc


async def push(mesh: InProcessMesh, *tables: router_pb2.WeightTable) -> list[router_pb2.WeightAck]:
    """Send tables on one PushWeights stream, one at a time; their acks (a refusal raises the stream's status)."""
    call = router_pb2_grpc.ControlStub(mesh.channel).PushWeights(timeout=5)
    acks = []
    for table in tables:
        await call.write(table)
        acks.append(await call.read())
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    return acks


def weights(
    mesh: InProcessMesh,
    version: int,
    *extra: router_pb2.WorkerWeight,
    weight: float = 0.5,
) -> router_pb2.WeightTable:
    """A table giving every worker of the mesh `weight`, plus extra entries."""
    table = router_pb2.WeightTable(version=version)
    for worker in mesh.workers:
        table.workers.add(address=worker.host.address, weight=weight, state=router_pb2.WORKER_STATE_SERVING)
    table.workers.extend(extra)
    return table


def snapshot(mesh: InProcessMesh) -> tuple[int, dict[str, float]]:
    pool = mesh.router.pool
    return pool.version, {a: e.weight for a, e in pool.entries.items()}


@pytest.mark.parametrize(
    ("weight", "needle"),
    [(math.nan, "weight nan"), (-0.25, "weight -0.25"), (1.5, "weight 1.5"), (math.inf, "weight inf")],
    ids=["nan", "negative", "above-one", "infinite"],
)
async def test_a_weight_outside_0_to_1_refuses_the_whole_table(mesh: InProcessMesh, weight: float, needle: str) -> None:
    before = snapshot(mesh)
    bad = router_pb2.WorkerWeight(address=mesh.workers[1].host.address, weight=weight)
    table = router_pb2.WeightTable(
        version=7, workers=[router_pb2.WorkerWeight(address=mesh.workers[0].host.address, weight=0.5), bad]
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await push(mesh, table)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details() or ""
    assert f"workers[1] ({mesh.workers[1].host.address!r})" in details and needle in details
    assert "must be a number in [0, 1]" in details
    assert snapshot(mesh) == before  # not even the good entry was applied


@pytest.mark.parametrize(
    ("address", "needle"),
    [
        ("nocolon", "must be host:port"),
        (":50061", "must be host:port"),
        ("host:0", "port 0 must be 1..65535"),
        ("host:65536", "port 65536 must be 1..65535"),
        ("host:http", "port 'http' must be 1..65535"),
        ("::1:50061", "an IPv6 host goes in brackets"),
        ("[::zz]:50061", "not an IPv6 address"),
        ("bad host:50061", "is not a host name"),
    ],
    ids=[
        "no-port",
        "no-host",
        "port-0",
        "port-too-big",
        "port-not-a-number",
        "ipv6-unbracketed",
        "ipv6-invalid",
        "space-in-host",
    ],
)
async def test_a_malformed_address_refuses_the_table(mesh: InProcessMesh, address: str, needle: str) -> None:
    before = snapshot(mesh)
    table = weights(mesh, 3, router_pb2.WorkerWeight(address=address, weight=0.5))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await push(mesh, table)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details() or ""
    assert f"workers[2] ({address!r})" in details and needle in details, details
    assert snapshot(mesh) == before


async def test_static_discovery_refuses_a_worker_the_router_was_not_given(mesh: InProcessMesh) -> None:
    assert mesh.router.config.discovery == "static"  # the default
    before = snapshot(mesh)
    table = weights(mesh, 4, router_pb2.WorkerWeight(address="10.0.0.9:50061", weight=1.0))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await push(mesh, table)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details() or ""
    assert "workers[2] ('10.0.0.9:50061')" in details and "not one of this router's --workers" in details
    assert "--discovery prober" in details  # what to change
    assert snapshot(mesh) == before and "10.0.0.9:50061" not in mesh.router.pool.entries


async def test_a_refused_table_ends_that_stream_only_and_a_good_one_applies_after_it(mesh: InProcessMesh) -> None:
    with pytest.raises(grpc.aio.AioRpcError):
        await push(mesh, weights(mesh, 5, weight=math.nan))
    acks = await push(mesh, weights(mesh, 6, weight=0.5))
    assert [(a.version, a.applied) for a in acks] == [(6, True)]
    assert snapshot(mesh) == (6, {w.host.address: 0.5 for w in mesh.workers})
    chunks = [c async for c in mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="x", max_tokens=2))]
    assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH


async def test_a_duplicate_address_refuses_the_table(mesh: InProcessMesh) -> None:
    address = mesh.workers[0].host.address
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await push(mesh, weights(mesh, 3, router_pb2.WorkerWeight(address=address, weight=0.5)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"workers[2] ({address!r}) is listed twice" in (info.value.details() or "")


async def test_prober_discovery_lets_a_table_add_a_worker() -> None:
    async with in_process_mesh(discovery="prober") as mesh:
        extra = "127.0.0.1:1"  # nothing listens there: watched, never healthy
        acks = await push(mesh, weights(mesh, 2, router_pb2.WorkerWeight(address=extra, weight=1.0)))
        assert [(a.version, a.applied) for a in acks] == [(2, True)]
        assert extra in mesh.router.pool.entries and not mesh.router.pool.entries[extra].healthy


def test_discovery_setting_is_checked() -> None:
    with pytest.raises(ConfigError, match="discovery must be one of static, dns, prober, got 'consul'"):
        RouterConfig(workers=("a:1",), discovery="consul")
    with pytest.raises(ConfigError, match="give at least one worker"):
        RouterConfig()
    assert RouterConfig(discovery="prober").workers == ()
    with pytest.raises(ConfigError, match="port 0 must be 1..65535"):
        RouterConfig(workers=("a:0",))
