"""Quotas per tenant on one router: reservations under concurrency, refusals' details, figures, reload, gateway."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from tests.support.gateway_helpers import gateway_over
from tests.support.mesh import InProcessMesh, in_process_mesh, wait_until
from tests.support.redis_server import free_port
from tokenmesh.client import Client
from tokenmesh.v1 import inference_pb2
from tokenmesh_gateway import hash_key

QUOTA = 1000


def quota_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "quotas.toml"
    path.write_text(text)
    return str(path)


async def outcome(mesh: InProcessMesh, **fields: object) -> list[inference_pb2.GenerateChunk] | grpc.aio.AioRpcError:
    try:
        return [c async for c in mesh.inference.Generate(inference_pb2.GenerateRequest(**fields))]
    except grpc.aio.AioRpcError as exc:
        return exc


def details(error: grpc.aio.AioRpcError) -> tuple[error_details_pb2.ErrorInfo, error_details_pb2.RetryInfo | None]:
    status = rpc_status.from_call(error)
    assert status is not None
    info, retry = error_details_pb2.ErrorInfo(), None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            detail.Unpack(info)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
    return info, retry


def served(results: list) -> int:
    """Tokens (prompt + completion) the generations that ran used, as their final chunks count them."""
    return sum(r[-1].usage.prompt_tokens + r[-1].usage.completion_tokens for r in results if isinstance(r, list))


async def test_32_concurrent_requests_of_one_tenant_stay_within_1000_tokens(tmp_path: Path) -> None:
    path = quota_file(tmp_path, f"[tenants]\nsearch = {{ tokens_per_minute = {QUOTA} }}\n")
    settings = {"metrics_port": free_port(), "metrics_tenants": ("search",)}
    async with in_process_mesh(quota_file=path, quota_window_s=30, **settings) as mesh:
        results = await asyncio.gather(
            *(outcome(mesh, prompt=f"q{i:02d}", max_tokens=60, labels={"tenant": "search"}) for i in range(32))
        )
        ran = [r for r in results if isinstance(r, list)]
        refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        assert served(results) <= QUOTA
        # Each reserves 3 bytes + 4 + 60 = 67: 14 fit (938); refunds (it uses 63) may let one more in.
        assert 14 <= len(ran) <= 15 and len(ran) + len(refused) == 32
        assert all(r[-1].usage.completion_tokens == 60 for r in ran)
        for error in refused:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            info, retry = details(error)
            assert info.reason == "QUOTA_TOKENS_PER_MINUTE" and info.metadata["tenant"] == "search"
            assert info.metadata["limit_tokens"] == str(QUOTA) and int(info.metadata["remaining_tokens"]) < 67
            assert retry is not None and 0 < retry.retry_delay.ToNanoseconds() / 1e9 <= 30 + 3
        refusals = mesh.router.metrics.registry.get_sample_value(
            "tokenmesh_router_quota_refusals_total", {"tenant": "search", "limit": "tokens"}
        )
        assert refusals == len(refused)
        # Another tenant is not limited by search's quota, and its chunks carry no figures.
        other = await outcome(mesh, prompt="hi", max_tokens=5, labels={"tenant": "ads"})
        assert isinstance(other, list) and not other[0].HasField("rate_limits")


async def test_the_first_chunk_carries_the_figures_and_refunds_come_back(tmp_path: Path) -> None:
    path = quota_file(tmp_path, "[tenants]\nsearch = { tokens_per_minute = 1000, requests_per_minute = 10 }\n")
    async with in_process_mesh(quota_file=path) as mesh:
        first = await outcome(mesh, prompt="hi", max_tokens=20, labels={"tenant": "search"})
        second = await outcome(mesh, prompt="hi", max_tokens=20, labels={"tenant": "search"})
        assert isinstance(first, list) and isinstance(second, list)
        figures = first[0].rate_limits
        assert (figures.limit_tokens, figures.remaining_tokens) == (1000, 1000 - 26)  # 2 bytes + 4 + 20 reserved
        assert (figures.limit_requests, figures.remaining_requests) == (10, 9)
        assert 54 <= figures.reset_tokens_s <= 66 and 54 <= figures.reset_requests_s <= 66
        assert not first[1].HasField("rate_limits")  # the first chunk only
        # The first used 3 + 20 of its 26: 3 came back before the second reserved.
        assert second[0].rate_limits.remaining_tokens == 1000 - 23 - 26
        assert second[0].rate_limits.remaining_requests == 8


async def test_refusals_say_which_limit_and_whether_to_retry(tmp_path: Path) -> None:
    path = quota_file(
        tmp_path,
        "[tenants]\nsmall = { tokens_per_minute = 50 }\nslow = { concurrent = 1 }\nfew = { requests_per_minute = 1 }\n"
        '"*" = { requests_per_minute = 0 }\n',
    )
    async with in_process_mesh(quota_file=path, backend_settings={"delay": 0.05}) as mesh:
        too_large = await outcome(mesh, prompt="hi", max_tokens=100, labels={"tenant": "small"})
        assert isinstance(too_large, grpc.aio.AioRpcError)
        assert too_large.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "lower max_tokens" in str(too_large.details())
        info, retry = details(too_large)
        assert info.reason == "QUOTA_TOKENS_PER_MINUTE" and retry is None  # it never fits

        running = asyncio.ensure_future(outcome(mesh, prompt="hi", max_tokens=20, labels={"tenant": "slow"}))
        await wait_until(lambda: any(b.started for b in mesh.backends))
        busy = await outcome(mesh, prompt="hi", max_tokens=2, labels={"tenant": "slow"})
        assert isinstance(busy, grpc.aio.AioRpcError)
        info, retry = details(busy)
        assert info.reason == "QUOTA_CONCURRENT" and retry is not None
        assert isinstance(await running, list)
        assert isinstance(await outcome(mesh, prompt="hi", max_tokens=2, labels={"tenant": "slow"}), list)

        assert isinstance(await outcome(mesh, prompt="hi", max_tokens=2, labels={"tenant": "few"}), list)
        again = await outcome(mesh, prompt="hi", max_tokens=2, labels={"tenant": "few"})
        assert isinstance(again, grpc.aio.AioRpcError)
        info, retry = details(again)
        assert info.reason == "QUOTA_REQUESTS_PER_MINUTE" and info.metadata["remaining_requests"] == "0"
        assert retry is not None and retry.retry_delay.seconds >= 50

        unknown = await outcome(mesh, prompt="hi", max_tokens=2, labels={"tenant": "stranger"})
        assert isinstance(unknown, grpc.aio.AioRpcError) and "may run no generation" in str(unknown.details())
        info, retry = details(unknown)
        assert info.reason == "QUOTA_REQUESTS_PER_MINUTE" and info.metadata["tenant"] == "stranger" and retry is None


async def test_a_changed_file_applies_and_a_wrong_one_keeps_the_quota(tmp_path: Path) -> None:
    path = quota_file(tmp_path, "[tenants]\nsearch = { requests_per_minute = 1 }\n")
    async with in_process_mesh(quota_file=path) as mesh:
        assert isinstance(await outcome(mesh, prompt="hi", max_tokens=2, labels={"tenant": "search"}), list)
        assert isinstance(await outcome(mesh, prompt="hi", max_tokens=2, labels={"tenant": "search"}), Exception)
        Path(path).write_text("[tenants]\nsearch = { requests_per_minute = 3 }\n")
        await wait_until(lambda: mesh.router.quotas.limits["search"].requests == 3, timeout=5)
        assert isinstance(await outcome(mesh, prompt="hi", max_tokens=2, labels={"tenant": "search"}), list)
        Path(path).write_text("[tenants]\nsearch = { requests_per_minute = 'many' }\n")
        await asyncio.sleep(2.5)  # two checks of the file
        assert mesh.router.quotas.limits["search"].requests == 3  # kept


async def test_a_generate_stream_call_carries_the_figures_too(tmp_path: Path) -> None:
    path = quota_file(tmp_path, "[tenants]\nsearch = { tokens_per_minute = 1000 }\n")
    async with in_process_mesh(quota_file=path) as mesh:
        async with Client([mesh.router.host.address]) as client:  # batched: one GenerateStream call
            chunks = [
                c
                async for c in client.generate(
                    inference_pb2.GenerateRequest(prompt="hi", max_tokens=4, labels={"tenant": "search"})
                )
            ]
        assert chunks[0].rate_limits.limit_tokens == 1000 and chunks[0].rate_limits.remaining_tokens == 1000 - 10


async def test_the_gateway_sends_the_x_ratelimit_headers_on_every_response(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{hash_key('sk-search')} search\n")
    path = quota_file(tmp_path, "[tenants]\nsearch = { tokens_per_minute = 100, requests_per_minute = 3 }\n")
    async with in_process_mesh(quota_file=path) as mesh, gateway_over(mesh, api_keys_file=str(keys)) as gw:
        auth = {"Authorization": "Bearer sk-search"}
        body = {"model": "fake", "prompt": "hi", "max_tokens": 10}
        async with httpx.AsyncClient(base_url=gw.url) as http:
            whole = await http.post("/completions", json=body, headers=auth)
            streamed = await http.post("/completions", json={**body, "stream": True}, headers=auth)
            too_large = await http.post("/completions", json={**body, "max_tokens": 200}, headers=auth)
        assert whole.status_code == 200 and streamed.status_code == 200
        assert whole.headers["x-ratelimit-limit-tokens"] == "100" and whole.headers["x-ratelimit-limit-requests"] == "3"
        assert whole.headers["x-ratelimit-remaining-tokens"] == str(100 - 16)
        assert whole.headers["x-ratelimit-remaining-requests"] == "2"
        assert whole.headers["x-ratelimit-reset-tokens"].endswith("s")
        assert streamed.headers["x-ratelimit-remaining-requests"] == "1"
        assert int(streamed.headers["x-ratelimit-remaining-tokens"]) == 100 - 13 - 16  # the first used 13 of 16
        assert too_large.status_code == 429 and too_large.json()["error"]["code"] == "resource_exhausted"
        assert "retry-after" not in too_large.headers  # it never fits
        assert too_large.headers["x-ratelimit-limit-tokens"] == "100"
        # The openai SDK sees the 429 as RateLimitError, with the headers.
        sdk = openai.AsyncOpenAI(base_url=gw.url, api_key="sk-search", max_retries=0)
        await sdk.completions.create(model="fake", prompt="hi", max_tokens=2)
        with pytest.raises(openai.RateLimitError) as limited:
            await sdk.completions.create(model="fake", prompt="hi", max_tokens=2)
        headers = limited.value.response.headers
        assert headers["x-ratelimit-remaining-requests"] == "0" and headers["x-ratelimit-limit-requests"] == "3"
        assert int(headers["retry-after"]) >= 50
