"""The gateway's Responses API over an in-process mesh: the real openai SDK, the events, background resume, cancel."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.gateway_helpers import gateway_over
from tests.support.mesh import InProcessMesh, expected_text, in_process_mesh, wait_until
from tokenmesh.router import Router, RouterConfig
from tokenmesh_gateway import Gateway, hash_key

OPENING = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def sdk(gateway: Gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.url, api_key="x", max_retries=0)


def running(mesh: InProcessMesh) -> list[Any]:
    """Generations on the fake engines that are neither finished nor cancelled."""
    return [g for b in mesh.backends for g in b.started if not g.cancelled.is_set()]


def deltas(events: list[Any]) -> list[Any]:
    return [e for e in events if e.type == "response.output_text.delta"]


async def test_the_sdk_creates_a_response_with_its_text_usage_and_echo(mesh: InProcessMesh) -> None:
    async with gateway_over(mesh) as gateway:
        client = sdk(gateway)
        response = await client.responses.create(
            model="fake",
            input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
            instructions="be brief",
            max_output_tokens=6,
            metadata={"ticket": "42"},
            extra_headers={"X-Request-Id": "r-1"},
        )
        assert response.id == "resp_r-1" and response.object == "response" and response.model == "fake"
        assert response.output_text == expected_text(6)
        assert response.status == "incomplete"  # the fake engine always stops at max_output_tokens
        assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
        assert response.usage is not None
        assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (3, 6, 9)
        assert response.instructions == "be brief" and response.metadata == {"ticket": "42"}
        assert response.max_output_tokens == 6 and response.background is False

        plain = await client.responses.create(model="fake", input="hi", max_output_tokens=2)
        assert plain.id.startswith("resp_") and plain.output_text == expected_text(2)


async def test_the_sdk_streams_every_event_in_order_numbered_from_the_seq(mesh: InProcessMesh) -> None:
    async with gateway_over(mesh) as gateway:
        client = sdk(gateway)

        async def one(i: int) -> None:
            stream = await client.responses.create(model="fake", input=f"hi {i}", max_output_tokens=20, stream=True)
            events = [e async for e in stream]
            pieces = deltas(events)
            assert [e.type for e in events] == [
                *OPENING,
                *["response.output_text.delta"] * len(pieces),
                *CLOSING,
                "response.incomplete",
            ]
            assert [e.sequence_number for e in events] == list(range(len(events)))
            assert "".join(e.delta for e in pieces) == expected_text(20)
            final = events[-1].response
            assert final.output_text == expected_text(20) and final.usage is not None
            assert final.usage.output_tokens == 20 and events[0].response.id == final.id
            assert {e.item_id for e in pieces} == {"msg_" + final.id.removeprefix("resp_")}

        await asyncio.gather(*(one(i) for i in range(24)))  # dozens of streams at once, each exact


async def test_a_background_stream_resumes_on_a_new_gateway_after_its_gateway_and_router_stopped() -> None:
    async with in_process_mesh(backend_settings={"delay": 0.03}) as mesh:
        workers = tuple(w.host.address for w in mesh.workers)
        spare = Router(RouterConfig(port=0, workers=workers, drain_grace_s=1))
        await spare.start()
        try:
            await wait_until(lambda: all(e.healthy and e.models for e in spare.pool.entries.values()))
            seen: list[Any] = []
            async with gateway_over(mesh, retry_deadline_s=2) as first:
                stream = await sdk(first).responses.create(
                    model="fake", input="hi", max_output_tokens=120, stream=True, background=True
                )
                async for event in stream:
                    seen.append(event)
                    if len(seen) == 12:
                        break
                await stream.close()
            await mesh.router.shutdown()  # the router that served it goes too
            assert running(mesh), "the generation outlives its gateway and its router"
            response_id = seen[0].response.id
            assert seen[0].response.status == "queued" and response_id.startswith("resp_bg-")
            after = seen[-1].sequence_number
            async with gateway_over(None, routers=(spare.host.address,)) as second:
                client = sdk(second)
                rest = [
                    e async for e in await client.responses.retrieve(response_id, stream=True, starting_after=after)
                ]
                every = seen + rest
                assert [e.sequence_number for e in every] == list(range(len(every)))  # each event exactly once
                assert "".join(e.delta for e in deltas(every)) == expected_text(120)
                assert every[-1].type == "response.incomplete" and every[-1].response.usage.output_tokens == 120
                # Retrieved again, whole: the same numbers and text as the pieces.
                whole = [e async for e in await client.responses.retrieve(response_id, stream=True)]
                assert [(e.type, e.sequence_number) for e in whole] == [(e.type, e.sequence_number) for e in every]
                polled = await client.responses.retrieve(response_id)
                assert polled.status == "incomplete" and polled.output_text == expected_text(120)
            assert sum(len(b.started) for b in mesh.backends) == 1  # one generation, followed, then adopted
        finally:
            await spare.shutdown()


async def test_background_poll_cancel_twice_and_delete() -> None:
    async with in_process_mesh(backend_settings={"delay": 0.02}) as mesh, gateway_over(mesh) as gateway:
        client = sdk(gateway)
        created = await client.responses.create(
            model="fake", input="hi", max_output_tokens=500, background=True, metadata={"job": "7"}
        )
        assert created.status in ("queued", "in_progress") and created.background is True
        await asyncio.sleep(0.2)
        polled = await client.responses.retrieve(created.id)
        assert polled.status == "in_progress" and polled.output_text.startswith("tok0 tok1 ")
        assert polled.metadata == {"job": "7"}
        cancelled = await client.responses.cancel(created.id)
        assert cancelled.status == "cancelled" and cancelled.output_text.startswith(polled.output_text)
        await wait_until(lambda: not running(mesh), timeout=2)
        again = await client.responses.cancel(created.id)  # idempotent
        assert again.status == "cancelled" and again.output_text == cancelled.output_text
        await client.responses.delete(created.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(created.id)


async def test_a_background_response_outlives_its_caller_and_expires() -> None:
    async with in_process_mesh() as mesh, gateway_over(mesh, responses_retention_s=2.0) as gateway:
        client = sdk(gateway)
        created = await client.responses.create(model="fake", input="hi", max_output_tokens=5, background=True)
        assert gateway.app is not None
        kept = gateway.app.responses.store.kept  # nobody reads it: the gateway follows it to its end
        await wait_until(lambda: all(k.finished for k in kept.values()), timeout=2)
        done = await client.responses.retrieve(created.id)
        assert done.status == "incomplete" and done.output_text == expected_text(5)
        await asyncio.sleep(2.1)  # created_at is whole seconds: expired 1..2 s after its creation
        with pytest.raises(openai.NotFoundError) as expired:
            await client.responses.retrieve(created.id)
        assert expired.value.code == "expired" and "kept 2 s from their creation" in expired.value.message


async def test_refusals_and_unknown_ids_name_the_field(mesh: InProcessMesh) -> None:
    async with gateway_over(mesh) as gateway:
        client = sdk(gateway)
        for field, extra in [
            ("previous_response_id", {"previous_response_id": "resp_x"}),
            ("tools", {"tools": [{"type": "web_search"}]}),
            ("reasoning", {"reasoning": {"effort": "high"}}),
            ("store", {"background": True, "store": False}),
        ]:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(model="fake", input="hi", **extra)
            assert refused.value.param == field, field
        with pytest.raises(openai.BadRequestError) as many:
            await client.responses.create(model="fake", input="hi", extra_body={"n": 2})
        assert many.value.param == "n"
        with pytest.raises(openai.NotFoundError) as model:
            await client.responses.create(model="gpt-4o", input="hi", background=True)
        assert model.value.code == "model_not_found"
        with pytest.raises(openai.NotFoundError) as foreground:
            await client.responses.retrieve("resp_not-a-background-one")
        assert "background responses only" in foreground.value.message
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve("resp_bg-9999999999-" + "0" * 32)  # never made
        async with httpx.AsyncClient(base_url=gateway.url) as http:
            wrong = await http.get("/responses/chatcmpl-1")
            assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "response_id"
            moved = await http.put("/responses")
            assert moved.status_code == 405 and moved.headers["allow"] == "POST"


async def test_a_tenant_can_neither_see_nor_cancel_another_tenants_background_response(
    mesh: InProcessMesh, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{hash_key('sk-search')} search\n{hash_key('sk-ads')} ads\n")
    for backend in mesh.backends:
        backend.delay = 0.02
    async with gateway_over(mesh, api_keys_file=str(keys)) as gateway:
        search = openai.AsyncOpenAI(base_url=gateway.url, api_key="sk-search", max_retries=0)
        ads = openai.AsyncOpenAI(base_url=gateway.url, api_key="sk-ads", max_retries=0)
        created = await search.responses.create(model="fake", input="hi", max_output_tokens=100, background=True)
        params = [g.params for b in mesh.backends for g in b.started][-1]
        assert params.request_id == "search/" + created.id.removeprefix("resp_")
        assert params.labels == {"tenant": "search"}
        for call in (ads.responses.retrieve, ads.responses.cancel):
            with pytest.raises(openai.NotFoundError):
                await call(created.id)
        assert running(mesh), "another tenant's cancel reached nothing"
        assert (await search.responses.cancel(created.id)).status == "cancelled"


async def test_a_gateway_over_another_router_follows_a_background_response_too_one_over_the_same_gets_409() -> None:
    async with in_process_mesh(backend_settings={"delay": 0.02}) as mesh:
        spare = Router(RouterConfig(port=0, workers=tuple(w.host.address for w in mesh.workers), drain_grace_s=1))
        await spare.start()
        try:
            await wait_until(lambda: all(e.healthy and e.models for e in spare.pool.entries.values()))
            async with (
                gateway_over(mesh) as first,
                gateway_over(mesh) as same_router,
                gateway_over(None, routers=(spare.host.address,)) as other_router,
            ):
                created = await sdk(first).responses.create(
                    model="fake", input="hi", max_output_tokens=250, background=True
                )
                # The router streams it to `first` already: after waiting 2 s for that stream to end, it refuses.
                with pytest.raises(openai.ConflictError) as conflict:
                    await sdk(same_router).responses.retrieve(created.id)
                assert conflict.value.code == "already_exists"
                assert same_router.app is not None and not same_router.app.responses.store.kept  # not kept as failed
                streams = await asyncio.gather(*(_events(gateway, created.id) for gateway in (first, other_router)))
                numbered = [[(e.type, e.sequence_number) for e in events] for events in streams]
                assert numbered[0] == numbered[1]
                assert all("".join(e.delta for e in deltas(events)) == expected_text(250) for events in streams)
                assert sum(len(b.started) for b in mesh.backends) == 1
                again = await sdk(same_router).responses.retrieve(created.id)  # `first`'s stream is over: adopted
                assert again.output_text == expected_text(250)
        finally:
            await spare.shutdown()


async def _events(gateway: Gateway, response_id: str) -> list[Any]:
    """Every event of a background response, streamed from its start through this gateway."""
    return [e async for e in await sdk(gateway).responses.retrieve(response_id, stream=True)]
