"""Quotas in the production shape: one router run as 2 processes sharing a real Redis, the gateway, SmolLM2.

The in-process tests (tests/mesh/test_quotas*.py) cover the rules; this one
starts the mesh as ``tokenmesh up`` does, each service its own process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import redis

from tests.support.quotas import OWN_CONNECTION, refusal_of, served_by_process
from tests.support.redis_server import RedisServer, redis_server
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc
from tokenmesh_gateway import hash_key

from .conftest import MeshHandle, running_mesh

pytestmark = pytest.mark.integration

QUOTA = 1000
WINDOW_S = 60
KEY = "sk-search"
RESERVED = 3 + 4 + 60
"""What each request reserves: its prompt (qNN: 3 bytes + 4) and max_tokens 60."""


@pytest.fixture
def quota_mesh(tmp_path: Path) -> Iterator[tuple[MeshHandle, RedisServer]]:
    """The mesh with 2 router processes counting tenant search's 1,000 tokens per minute in one Redis."""
    quotas = tmp_path / "quotas.toml"
    quotas.write_text(f"[tenants]\nsearch = {{ tokens_per_minute = {QUOTA} }}\n")
    keys = tmp_path / "keys"
    keys.write_text(f"{hash_key(KEY)} search\n")
    with redis_server() as server:
        env = {
            "TOKENMESH_ROUTER_QUOTA_FILE": str(quotas),
            "TOKENMESH_ROUTER_QUOTA_REDIS_URL": server.url,
            "TOKENMESH_ROUTER_QUOTA_WINDOW_S": str(WINDOW_S),
            "TOKENMESH_GATEWAY_API_KEYS_FILE": str(keys),
        }
        with running_mesh(tmp_path, router_processes=2, gateway_port=0, extra_env=env) as handle:
            yield handle, server


async def generate(address: str, i: int) -> inference_pb2.GenerateChunk | grpc.aio.AioRpcError:
    """One generation of tenant search on a connection of its own: its final chunk, or its error."""
    request = inference_pb2.GenerateRequest(prompt=f"q{i:02d}", max_tokens=60, labels={"tenant": "search"})
    async with grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as channel:
        try:
            return [c async for c in inference_pb2_grpc.InferenceStub(channel).Generate(request, timeout=120)][-1]
        except grpc.aio.AioRpcError as exc:
            return exc


def redis_count(server: RedisServer) -> int:
    with redis.Redis(port=server.port) as client:
        return sum(int(v) for v in client.hgetall("tm:quota:{search}:tokens").values())


async def test_32_concurrent_requests_over_2_router_processes_and_the_gateway_stay_within_1000_tokens(
    quota_mesh: tuple[MeshHandle, RedisServer],
) -> None:
    handle, server = quota_mesh
    assert handle.mesh.gateway is not None
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "smollm2", "prompt": "q99", "max_tokens": 60}
    async with httpx.AsyncClient(base_url=str(handle.mesh.gateway.info["url"]), timeout=120) as http:
        first = await http.post("/completions", json=body, headers=auth)
        assert first.status_code == 200, first.text
        # Counted in Redis for the whole mesh: a router process counting its own share would have 500.
        assert first.headers["x-ratelimit-limit-tokens"] == str(QUOTA)
        assert first.headers["x-ratelimit-remaining-tokens"] == str(QUOTA - RESERVED)
        assert first.headers["x-ratelimit-reset-tokens"].endswith("s")
        usage = first.json()["usage"]
        used = usage["prompt_tokens"] + usage["completion_tokens"]

        before = await served_by_process(handle.address)
        results = await asyncio.gather(*(generate(handle.address, i) for i in range(32)))
        after = await served_by_process(handle.address)
        ran = [r for r in results if isinstance(r, inference_pb2.GenerateChunk)]
        refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        used += sum(r.usage.prompt_tokens + r.usage.completion_tokens for r in ran)
        assert used <= QUOTA
        # All 32 are admitted or refused before any ends: what the first left fits 13 or 14 reservations.
        assert (QUOTA - RESERVED) // RESERVED <= len(ran) <= QUOTA // RESERVED and len(ran) + len(refused) == 32
        for error in refused:
            kind, hint = refusal_of(error)
            assert kind == "RESOURCE_EXHAUSTED QUOTA_TOKENS_PER_MINUTE"
            assert hint is not None and 0 < hint <= WINDOW_S * 1.1 + 1
        # Both processes served some (the kernel spreads the 32 connections by hash).
        served = {i: after[i] - before.get(i, 0) for i in after}
        assert set(served) == {0, 1} and all(served.values()) and sum(served.values()) == len(ran), served
        for _ in range(50):  # the refunds of the last generations reach Redis
            if redis_count(server) == used:
                break
            await asyncio.sleep(0.1)
        assert redis_count(server) == used

        # The next one that does not fit in what is left (the refunds are in) is refused, with the headers.
        remaining = QUOTA - used
        late_body = {**body, "max_tokens": max(1, remaining - 6)}  # reserves 7 + max_tokens > remaining
        asked = time.monotonic()
        late = await http.post("/completions", json=late_body, headers=auth)
        waited = time.monotonic() - asked
    assert late.status_code == 429 and late.json()["error"]["code"] == "resource_exhausted", late.text
    assert late.headers["x-ratelimit-limit-tokens"] == str(QUOTA)
    assert late.headers["x-ratelimit-remaining-tokens"] == str(remaining)
    assert 0 < int(late.headers["retry-after"]) <= WINDOW_S * 1.1 + 1
    # Its hint ends past the gateway's retry deadline (10 s): refused at once, not retried until the deadline.
    assert waited < 5, waited
