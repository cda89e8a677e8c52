"""The gateway's Anthropic Messages API over an in-process mesh: the real anthropic SDK, the events, the errors."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest

from tests.support.gateway_helpers import Reader, gateway_over
from tests.support.mesh import InProcessMesh, expected_text, in_process_mesh, wait_until
from tokenmesh_gateway import Gateway, hash_key

USER: list[Any] = [{"role": "user", "content": "hi"}]


def sdk(gateway: Gateway, **settings: Any) -> anthropic.AsyncAnthropic:
    """The SDK on the gateway (its base URL is the host: the SDK adds /v1/messages), no retries of its own."""
    settings.setdefault("api_key", "x")
    return anthropic.AsyncAnthropic(base_url=gateway.url.removesuffix("/v1"), max_retries=0, **settings)


def dead_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def error_of(exc: pytest.ExceptionInfo[anthropic.APIStatusError]) -> Any:
    """The ``error`` object of the body the SDK's exception carries, after checking the envelope."""
    body: Any = exc.value.body
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return body["error"]


def fields_of(raw: bytes) -> list[dict[str, str]]:
    """The fields (event, data, id) of each event of an SSE body, comment lines dropped."""
    found = []
    for block in raw.split(b"\n\n"):
        fields = dict(line.decode().partition(": ")[::2] for line in block.split(b"\n") if line and line[:1] != b":")
        if fields:
            found.append(fields)
    return found


def named_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each event of an SSE body."""
    return [(fields["event"], orjson.loads(fields["data"])) for fields in fields_of(raw)]


def text_of(raw: bytes) -> str:
    """The text of the deltas of an SSE body."""
    return "".join(data["delta"]["text"] for name, data in named_events(raw) if name == "content_block_delta")


async def test_create_answers_a_message_with_its_text_usage_and_stop_reason(mesh: InProcessMesh) -> None:
    async with gateway_over(mesh) as gateway:
        client = sdk(gateway)
        message = await client.messages.create(
            model="fake",
            max_tokens=5,
            system=[{"type": "text", "text": "Be brief."}],
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}
            ],
            extra_body={"temperature": 0.5, "top_p": 0.9},  # on the wire still; this SDK no longer types them
            stop_sequences=["\n\n"],
            metadata={"user_id": "alice"},
            extra_headers={"anthropic-version": "2023-06-01", "X-Request-Id": "m-1"},
        )
    assert message.id == "msg_m-1" and message.type == "message" and message.role == "assistant"
    assert message.model == "fake"
    assert [(block.type, block.text) for block in message.content if block.type == "text"] == [
        ("text", expected_text(5))
    ]
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert (message.usage.input_tokens, message.usage.output_tokens) == (3, 5)
    params = mesh.backends[0].started + mesh.backends[1].started
    assert len(params) == 1
    sent = params[0].params
    assert sent.messages == (("system", "Be brief."), ("user", "hi there"))
    assert (sent.temperature, round(sent.top_p or 0, 3), sent.stop) == (0.5, 0.9, ("\n\n",))
    assert sent.labels["user"] == "alice"


async def test_the_stream_sends_anthropics_events_in_order_and_the_sdk_assembles_the_message(
    mesh: InProcessMesh,
) -> None:
    async with gateway_over(mesh) as gateway:
        client = sdk(gateway)
        async with client.messages.stream(model="fake", max_tokens=7, messages=USER) as stream:
            deltas = [text async for text in stream.text_stream]
            final = await stream.get_final_message()
        assert "".join(deltas) == expected_text(7) and len(deltas) == 7
        assert final.content[0].type == "text" and final.content[0].text == expected_text(7)
        assert final.stop_reason == "max_tokens" and final.id.startswith("msg_")
        assert (final.usage.input_tokens, final.usage.output_tokens) == (3, 7)

        async with httpx.AsyncClient(base_url=gateway.url) as http:
            response = await http.post(
                "/messages", json={"model": "fake", "max_tokens": 3, "messages": USER, "stream": True}
            )
    assert response.status_code == 200 and response.headers["content-type"] == "text/event-stream"
    got = named_events(response.content)
    assert [name for name, _ in got] == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * 3,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in got)
    start = got[0][1]["message"]
    assert (start["role"], start["content"], start["model"], start["stop_reason"]) == ("assistant", [], "fake", None)
    assert got[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert [d["delta"] for _, d in got[3:6]] == [{"type": "text_delta", "text": f"tok{i} "} for i in range(3)]
    assert got[7][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
        "usage": {"input_tokens": 3, "cache_read_input_tokens": 0, "output_tokens": 3},
    }


async def test_dozens_of_concurrent_streams_each_get_exactly_their_text() -> None:
    async with in_process_mesh(backend_settings={"delay": 0.005}) as mesh, gateway_over(mesh) as gateway:
        client = sdk(gateway)

        async def one(n: int) -> tuple[str, int, int]:
            async with client.messages.stream(model="fake", max_tokens=n, messages=USER) as stream:
                text = "".join([t async for t in stream.text_stream])
                final = await stream.get_final_message()
            return text, final.usage.output_tokens, final.usage.input_tokens

        lengths = [5 + i % 17 for i in range(40)]
        results = await asyncio.gather(*(one(n) for n in lengths))
    assert results == [(expected_text(n), n, 3) for n in lengths]


async def test_a_caller_that_leaves_a_stream_cancels_its_generation() -> None:
    async with in_process_mesh(backend_settings={"delay": 0.02}) as mesh, gateway_over(mesh) as gateway:
        client = sdk(gateway)
        async with client.messages.stream(model="fake", max_tokens=500, messages=USER) as stream:
            async for _ in stream.text_stream:
                break
        await wait_until(lambda: all(g.cancelled.is_set() for b in mesh.backends for g in b.started))
        assert sum(len(b.started) for b in mesh.backends) == 1


async def test_a_dropped_stream_resumes_with_last_event_id_exactly_the_rest() -> None:
    async with in_process_mesh(backend_settings={"delay": 0.02}) as mesh, gateway_over(mesh) as gateway:
        body = {"model": "fake", "max_tokens": 30, "messages": USER, "stream": True}
        async with httpx.AsyncClient(base_url=gateway.url) as http:
            async with http.stream("POST", "/messages", json=body, headers={"X-Request-Id": "story"}) as response:
                seen = await Reader(response).events(8)
            seen = seen[: seen.rindex(b"\n\n") + 2]  # what a client had whole when the connection dropped
            last_id = [fields["id"] for fields in fields_of(seen) if "id" in fields][-1]
            await asyncio.sleep(0.1)
            assert sum(not g.cancelled.is_set() for b in mesh.backends for g in b.started) == 1  # detached
            rest = await http.post("/messages", json=body, headers={"Last-Event-ID": last_id})
    assert rest.status_code == 200 and last_id.startswith("story:")
    assert text_of(seen) + text_of(rest.content) == expected_text(30)
    names = [name for name, _ in named_events(rest.content)]
    assert "message_start" not in names and names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert named_events(rest.content)[-2][1]["usage"] == {
        "input_tokens": 3,
        "cache_read_input_tokens": 0,
        "output_tokens": 30,
    }


# -- errors ------------------------------------------------------------------------------------------------------


async def test_requests_the_mesh_cannot_honour_are_bad_requests_naming_the_field(mesh: InProcessMesh) -> None:
    async with gateway_over(mesh) as gateway:
        client = sdk(gateway)
        refused: list[tuple[dict[str, Any], str]] = [
            ({"model": "fake", "messages": USER}, "max_tokens"),  # Anthropic requires it
            ({"max_tokens": 0, "messages": USER}, "max_tokens"),
            ({"max_tokens": 5, "messages": USER, "tools": [{"name": "f", "input_schema": {}}]}, "tools"),
            ({"max_tokens": 5, "messages": USER, "tool_choice": {"type": "any"}}, "tool_choice"),
            ({"max_tokens": 5, "messages": USER, "top_k": -5}, "top_k"),
            ({"max_tokens": 5, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
            ({"max_tokens": 5, "messages": USER, "temperature": 1.5}, "temperature"),
            ({"max_tokens": 5, "messages": USER, "metadata": {"tenant": "x"}}, "metadata.tenant"),
            (
                {
                    "max_tokens": 5,
                    "messages": [
                        {
                            "role": "user",
                            "content": [{"type": "image", "source": {"type": "url", "url": "http://x/a.png"}}],
                        }
                    ],
                },
                "messages[0].content[0]",
            ),
            ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
            ({"max_tokens": 5, "messages": [*USER, {"role": "assistant", "content": "tok"}]}, "messages[1].role"),
            ({"max_tokens": 5, "messages": []}, "messages"),
        ]
        for body, field in refused:
            with pytest.raises(anthropic.BadRequestError) as bad:
                await client.post("/v1/messages", body=body, cast_to=anthropic.types.Message)
            assert bad.value.status_code == 400, body
            error = error_of(bad)
            assert error["type"] == "invalid_request_error" and error["message"].startswith(field), (field, error)
        # Neutral values of the refused fields pass, as SDKs send them.
        fine = await client.messages.create(
            model="fake", max_tokens=2, messages=USER, tools=[], thinking={"type": "disabled"}
        )
        assert fine.content[0].type == "text" and fine.content[0].text == expected_text(2)
        assert [g for b in mesh.backends for g in b.started].__len__() == 1  # nothing refused reached a worker

        with pytest.raises(anthropic.NotFoundError) as missing:
            await client.messages.create(model="no-such-model", max_tokens=5, messages=USER)
        assert error_of(missing)["type"] == "not_found_error"
        assert "no-such-model" in missing.value.message

        async with httpx.AsyncClient(base_url=gateway.url) as http:
            not_json = await http.post("/messages", content=b"{nope")
            wrong_method = await http.get("/messages")
    assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "invalid_request_error"
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert wrong_method.json()["type"] == "error"


async def test_keys_are_taken_from_x_api_key_or_authorization(mesh: InProcessMesh, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{hash_key('sk-search')} search\n")
    async with gateway_over(mesh, api_keys_file=str(keys)) as gateway:
        with pytest.raises(anthropic.AuthenticationError) as refused:
            await sdk(gateway, api_key="sk-wrong").messages.create(model="fake", max_tokens=2, messages=USER)
        assert refused.value.status_code == 401
        assert error_of(refused)["type"] == "authentication_error"
        by_x_api_key = await sdk(gateway, api_key="sk-search").messages.create(
            model="fake", max_tokens=2, messages=USER
        )
        by_bearer = await sdk(gateway, api_key=None, auth_token="sk-search").messages.create(
            model="fake", max_tokens=3, messages=USER
        )
        async with httpx.AsyncClient(base_url=gateway.url) as http:
            none = await http.post("/messages", json={"max_tokens": 2, "messages": USER})
            chat = await http.post(
                "/chat/completions", json={"messages": USER, "max_tokens": 1}, headers={"x-api-key": "sk-search"}
            )
    assert [(b.type, getattr(b, "text", None)) for b in by_x_api_key.content] == [("text", expected_text(2))]
    assert [(b.type, getattr(b, "text", None)) for b in by_bearer.content] == [("text", expected_text(3))]
    assert none.status_code == 401 and "x-api-key" in none.json()["error"]["message"]
    assert chat.status_code == 200  # the header is a key on every route
    assert {g.params.labels.get("tenant") for b in mesh.backends for g in b.started} == {"search"}


async def test_admission_refusal_is_a_rate_limit_and_no_live_router_is_overloaded() -> None:
    async with in_process_mesh(queue_timeout_s=0.1) as mesh, gateway_over(mesh, retry_deadline_s=0.3) as gateway:
        client = sdk(gateway)
        for backend in mesh.backends:
            backend.delay = 0.05
        hold = [
            asyncio.create_task(
                client.messages.create(model="fake", max_tokens=200, messages=[{"role": "user", "content": f"f{i}"}])
            )
            for i in range(8)
        ]
        await wait_until(lambda: sum(not g.cancelled.is_set() for b in mesh.backends for g in b.started) == 8)
        with pytest.raises(anthropic.RateLimitError) as limited:
            await client.messages.create(model="fake", max_tokens=2, messages=USER)
        assert limited.value.status_code == 429
        assert error_of(limited)["type"] == "rate_limit_error"
        assert int(limited.value.response.headers["retry-after"]) >= 1
        for task in hold:
            task.cancel()
        await asyncio.gather(*hold, return_exceptions=True)

    async with gateway_over(None, routers=(dead_address(),), retry_deadline_s=0.3) as gateway:
        with pytest.raises(anthropic.OverloadedError) as overloaded:
            await sdk(gateway).messages.create(model="fake", max_tokens=2, messages=USER, stream=True)
    assert overloaded.value.status_code == 529
    assert error_of(overloaded)["type"] == "overloaded_error"
    assert overloaded.value.response.headers["retry-after"] == "1"


async def test_an_error_mid_stream_is_an_error_event_the_sdk_raises() -> None:
    async with in_process_mesh(backend_settings={"delay": 0.01}, max_migrations=0) as mesh, gateway_over(mesh) as gw:
        for backend in mesh.backends:
            backend.fail_after = 3
        texts: list[str] = []
        with pytest.raises(anthropic.APIStatusError) as failed:
            async with sdk(gw).messages.stream(model="fake", max_tokens=10, messages=USER) as stream:
                async for text in stream.text_stream:
                    texts.append(text)
        async with httpx.AsyncClient(base_url=gw.url) as http:
            raw = await http.post("/messages", json={"max_tokens": 10, "messages": USER, "stream": True})
    assert "".join(texts) == expected_text(3)
    assert error_of(failed)["type"] == "overloaded_error"
    got = named_events(raw.content)
    assert got[-1][0] == "error" and [name for name, _ in got].count("message_stop") == 0
    assert set(got[-1][1]) == {"type", "error"} and set(got[-1][1]["error"]) == {"type", "message"}
