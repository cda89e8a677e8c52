"""Quotas shared by two routers through a real Redis: held for the whole mesh, and Redis stopped and started mid-run."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import redis.asyncio

from tests.support.mesh import InProcessMesh, in_process_mesh, wait_until
from tests.support.redis_server import RedisServer, redis_server
from tokenmesh.router import Router, RouterConfig
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc

QUOTA = 1000
WINDOW_S = 30


@contextlib.asynccontextmanager
async def two_routers(tmp_path: Path, server: RedisServer) -> AsyncIterator[tuple[InProcessMesh, Router]]:
    """The in-process mesh's router and a second one over the same workers, both counting quotas in server."""
    path = tmp_path / "quotas.toml"
    path.write_text(f"[tenants]\nsearch = {{ tokens_per_minute = {QUOTA} }}\n")
    settings: dict[str, object] = {"quota_file": str(path), "quota_redis_url": server.url, "quota_window_s": WINDOW_S}
    async with in_process_mesh(**settings) as mesh:
        workers = tuple(w.host.address for w in mesh.workers)
        second = Router(RouterConfig(port=0, workers=workers, drain_grace_s=1, **settings))  # type: ignore[arg-type]
        await second.start()
        try:
            await wait_until(lambda: all(e.healthy and e.models for e in second.pool.entries.values()))
            await wait_until(lambda: mesh.router.quotas.routers == 2 == second.quotas.routers, timeout=5)
            yield mesh, second
        finally:
            await second.shutdown()


async def burst(addresses: list[str], n: int) -> tuple[int, list[grpc.aio.AioRpcError]]:
    """n concurrent generations of tenant search (67 tokens reserved each), spread over the routers.

    Returns the tokens the ones that ran used and the refusals.
    """
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    try:

        async def one(i: int) -> list[inference_pb2.GenerateChunk] | grpc.aio.AioRpcError:
            stub = inference_pb2_grpc.InferenceStub(channels[i % len(channels)])
            request = inference_pb2.GenerateRequest(prompt=f"q{i:02d}", max_tokens=60, labels={"tenant": "search"})
            try:
                return [c async for c in stub.Generate(request)]
            except grpc.aio.AioRpcError as exc:
                return exc

        results = await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        for channel in channels:
            await channel.close()
    used = sum(r[-1].usage.prompt_tokens + r[-1].usage.completion_tokens for r in results if isinstance(r, list))
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert {e.code() for e in refused} <= {grpc.StatusCode.RESOURCE_EXHAUSTED}
    return used, refused


async def test_two_routers_sharing_redis_hold_one_quota_for_32_concurrent_requests(tmp_path: Path) -> None:
    with redis_server() as server:
        async with two_routers(tmp_path, server) as (mesh, second):
            used, refused = await burst([mesh.router.host.address, second.host.address], 32)
            assert used <= QUOTA
            assert 14 <= 32 - len(refused) <= 15  # 67 reserved each: 14 fit, a refund or two may let one more in
            await wait_until(lambda: not mesh.router.quotas.releasing and not second.quotas.releasing)
            client = redis.asyncio.Redis(port=server.port)
            try:
                counted = await client.hgetall("tm:quota:{search}:tokens")
            finally:
                await client.aclose()
            assert sum(int(v) for v in counted.values()) == used  # refunds settled: what was used, no more


async def test_redis_stopped_mid_run_the_mesh_serves_each_routers_share_and_restarted_quotas_resume(
    tmp_path: Path,
) -> None:
    with redis_server() as server:
        async with two_routers(tmp_path, server) as (mesh, second):
            first = mesh.router.host.address
            used, _ = await burst([first], 4)
            assert used == 4 * 63
            server.stop()
            # Fail open: each router grants its share (1000 / 2 routers) alone; nothing waits for Redis.
            started = asyncio.get_running_loop().time()
            used_first, refused = await burst([first], 12)
            assert 500 - 67 < used_first <= 500 and refused  # 7 of 67 fit its 500
            assert asyncio.get_running_loop().time() - started < 5
            assert not mesh.router.quotas.shared_up
            assert mesh.router.metrics.registry.get_sample_value("tokenmesh_router_quota_store_up") == 0
            used_second, _ = await burst([second.host.address], 12)
            assert 500 - 67 < used_second <= 500
            server.start()  # empty, as a Redis that lost its data
            await wait_until(lambda: mesh.router.quotas.shared_up and second.quotas.shared_up, timeout=5)
            assert mesh.router.metrics.registry.get_sample_value("tokenmesh_router_quota_store_up") == 1
            # The whole quota is the mesh's again, counted in Redis.
            used, refused = await burst([first, second.host.address], 32)
            assert used <= QUOTA and 14 <= 32 - len(refused) <= 15
