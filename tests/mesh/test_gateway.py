"""The HTTP gateway over an in-process mesh: the openai SDK, the exact SSE bytes, errors, resume, disconnects."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import httpx
import openai
import orjson
import pytest
from openai._streaming import SSEDecoder

from tests.support.gateway_helpers import Reader, datas, events, gateway_over, text_after, text_of
from tests.support.mesh import InProcessMesh, in_process_mesh, wait_until
from tokenmesh_gateway import hash_key

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def tokens(n: int, first: int = 0) -> str:
    return "".join(f"tok{i} " for i in range(first, first + n))


def dead_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def running(mesh: InProcessMesh) -> list:
    """Generations on the fake engines that are neither finished nor cancelled (started ones only)."""
    return [g for b in mesh.backends for g in b.started if not g.cancelled.is_set()]


# -- the openai SDK ---------------------------------------------------------------


async def test_the_openai_sdk_streams_chat_and_completions_with_usage(mesh: InProcessMesh) -> None:
    async with gateway_over(mesh) as gateway:
        client = openai.AsyncOpenAI(base_url=gateway.url, api_key="x", max_retries=0)
        stream = await client.chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == tokens(6)
        assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
        assert {c.created for c in chunks} == {chunks[0].created}
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (3, 6)
        assert chunks[-1].usage.total_tokens == 9

        completion_stream = await client.completions.create(
            model="fake", prompt="hi", max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
        parts = [c async for c in completion_stream]
        assert all(p.object == "text_completion" for p in parts)
        assert "".join(p.choices[0].text for p in parts if p.choices) == tokens(4)
        assert parts[-1].usage is not None and parts[-1].usage.completion_tokens == 4

        chat = await client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
        assert chat.choices[0].message.content == tokens(3) and chat.choices[0].finish_reason == "length"
        assert chat.usage is not None and (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (3, 3)

        completion = await client.completions.create(model="fake", prompt="hi", max_tokens=2)
        assert completion.object == "text_completion" and completion.choices[0].text == tokens(2)
        assert completion.usage is not None and completion.usage.completion_tokens == 2

        models = await client.models.list()
        assert [(m.id, m.object, m.owned_by) for m in models.data] == [("fake", "model", "tokenmesh")]
        assert models.data[0].model_extra == {"max_model_len": 512}
        assert (await client.models.retrieve("fake")).id == "fake"


async def test_logprobs_reach_the_sdk_one_per_token_streamed_and_whole(mesh: InProcessMesh) -> None:
    async with gateway_over(mesh) as gateway:
        client = openai.AsyncOpenAI(base_url=gateway.url, api_key="x", max_retries=0)
        user = [{"role": "user", "content": "hi"}]
        stream = await client.chat.completions.create(
            model="fake",
            messages=user,
            max_tokens=5,
            stream=True,
            logprobs=True,
            top_logprobs=2,  # type: ignore[arg-type]
        )
        content = [
            e
            for c in [c async for c in stream]
            if c.choices and c.choices[0].logprobs
            for e in c.choices[0].logprobs.content or []
        ]
        assert [e.token for e in content] == [f"tok{i} " for i in range(5)]
        assert all(e.logprob == -0.25 and [a.logprob for a in e.top_logprobs] == [-0.25, -0.5] for e in content)
        whole = await client.chat.completions.create(
            model="fake",
            messages=user,
            max_tokens=4,
            logprobs=True,
            top_logprobs=1,  # type: ignore[arg-type]
        )
        assert whole.choices[0].logprobs is not None and whole.choices[0].logprobs.content is not None
        assert [e.token for e in whole.choices[0].logprobs.content] == [f"tok{i} " for i in range(4)]
        completion = await client.completions.create(model="fake", prompt="hi", max_tokens=3, logprobs=2)
        columns = completion.choices[0].logprobs
        assert columns is not None and columns.tokens == [f"tok{i} " for i in range(3)]
        assert columns.text_offset == [0, 5, 10] and columns.top_logprobs == [{"alt0": -0.25, "alt1": -0.5}] * 3
        plain = await client.chat.completions.create(model="fake", messages=user, max_tokens=2)  # type: ignore[arg-type]
        assert plain.choices[0].logprobs is None
        schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
        await client.chat.completions.create(
            model="fake",
            messages=user,  # type: ignore[arg-type]
            max_tokens=2,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        )
        assert any(g.params.structured == {"json": schema} for b in mesh.backends for g in b.started)


async def test_the_sdk_maps_the_gateway_errors_to_its_exception_classes() -> None:
    async with in_process_mesh(queue_timeout_s=0.1) as mesh, gateway_over(mesh, retry_deadline_s=0.3) as gateway:
        client = openai.AsyncOpenAI(base_url=gateway.url, api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model="fake", prompt="hi", max_tokens=100_000)
        assert bad.value.status_code == 400 and bad.value.param == "max_tokens"
        assert bad.value.code == "invalid_argument" and "max_tokens must be 1..512" in bad.value.message
        with pytest.raises(openai.BadRequestError) as unsupported:
            await client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], n=2)
        assert unsupported.value.param == "n"
        with pytest.raises(openai.NotFoundError) as missing:
            await client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
        assert missing.value.code == "model_not_found" and missing.value.param == "model"
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("gpt-4o")

        # Every slot taken and the queue wait (0.1 s) too short: 429 with the router's retry hint.
        for backend in mesh.backends:
            backend.delay = 0.05
        hold = [
            asyncio.create_task(client.completions.create(model="fake", prompt=f"fill{i}", max_tokens=200))
            for i in range(8)
        ]
        await wait_until(lambda: len(running(mesh)) == 8)
        with pytest.raises(openai.RateLimitError) as limited:
            await client.completions.create(model="fake", prompt="late", max_tokens=2)
        assert limited.value.status_code == 429 and limited.value.code == "resource_exhausted"
        assert int(limited.value.response.headers["retry-after"]) >= 1
        assert int(limited.value.response.headers["retry-after-ms"]) > 0
        for task in hold:
            task.cancel()
        await asyncio.gather(*hold, return_exceptions=True)

    async with gateway_over(None, routers=(dead_address(),), retry_deadline_s=0.3) as gateway:
        client = openai.AsyncOpenAI(base_url=gateway.url, api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as down:
            await client.chat.completions.create(
                model="fake", messages=[{"role": "user", "content": "hi"}], stream=True
            )
        assert down.value.status_code == 503 and down.value.code == "unavailable"
        assert down.value.response.headers["retry-after"] == "1"


async def test_a_generation_over_its_timeout_is_504() -> None:
    async with in_process_mesh(backend_settings={"delay": 0.5}) as mesh, gateway_over(mesh, timeout_s=0.2) as gateway:
        async with httpx.AsyncClient(base_url=gateway.url) as http:
            response = await http.post("/chat/completions", json={**CHAT, "stream": True, "max_tokens": 5})
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "deadline_exceeded"


# -- the wire format ----------------------------------------------------------------


async def test_sse_bytes_headers_ids_and_done(mesh: InProcessMesh) -> None:
    for backend in mesh.backends:  # a token each 20 ms: one event each (unread tokens merge on a loaded machine)
        backend.delay = 0.02
    async with gateway_over(mesh) as gateway, httpx.AsyncClient(base_url=gateway.url) as http:
        body = {**CHAT, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
        async with http.stream("POST", "/chat/completions", json=body, headers={"X-Request-Id": "r-1"}) as response:
            raw = await response.aread()
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    assert response.headers["x-request-id"] == "r-1"
    assert raw.endswith(b"\n\ndata: [DONE]\n\n") and raw.count(b"[DONE]") == 1
    blocks = raw.split(b"\n\n")[:-1]
    # One event per token chunk, then the finish event, then the usage event with the last chunk's id.
    ids = [e.get("id") for e in events(raw)]
    assert ids == ["r-1:1", "r-1:2", "r-1:3", "r-1:4", None, "r-1:5", None]
    payloads = datas(raw)
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "tok0 "}
    assert [c["choices"][0]["delta"] for c in chunks[1:4]] == [{"content": f"tok{i} "} for i in range(1, 4)]
    assert chunks[4]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert chunks[5]["choices"] == [] and chunks[5]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert {c["id"] for c in chunks} == {"chatcmpl-r-1"} and len({c["created"] for c in chunks}) == 1
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and {c["model"] for c in chunks} == {"fake"}
    for block in blocks:  # each event: "id: ..." and "data: ..." lines, nothing else
        assert all(line.startswith((b"id: ", b"data: ")) for line in block.split(b"\n")), block


async def test_completions_events_and_continuous_usage(mesh: InProcessMesh) -> None:
    async with gateway_over(mesh) as gateway, httpx.AsyncClient(base_url=gateway.url) as http:
        body = {
            "prompt": "hi",
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        response = await http.post("/completions", json=body)
    chunks = datas(response.content)[:-1]
    assert [c["object"] for c in chunks] == ["text_completion"] * 5
    assert [c["choices"][0]["text"] for c in chunks[:4]] == ["tok0 ", "tok1 ", "tok2 ", ""]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 3, 3]
    assert chunks[3]["usage"]["prompt_tokens"] == 3 and chunks[3]["choices"][0]["finish_reason"] == "length"


async def test_keep_alive_comments_in_a_silent_stream_pass_through_the_sdk() -> None:
    async with in_process_mesh(backend_settings={"delay": 0.25}) as mesh, gateway_over(mesh, keepalive_s=0.05) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as http:
            response = await http.post(
                "/chat/completions", json={**CHAT, "stream": True, "max_tokens": 3}, headers={"X-Request-Id": "quiet"}
            )
        raw = response.content
        # Comments come after the first id line, alone: never a comment block that the SDK would dispatch.
        assert raw.count(b": keep-alive\n") >= 3
        assert raw.index(b"id: quiet:1\n") < raw.rindex(b": keep-alive\n")
        assert b": keep-alive\n\n" not in raw
        assert text_of(raw) == tokens(3)
        client = openai.AsyncOpenAI(base_url=gw.url, api_key="x", max_retries=0)
        stream = await client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
        assert "".join([c.choices[0].delta.content or "" async for c in stream]) == tokens(3)


def test_why_keep_alive_is_a_lone_comment_line() -> None:
    # The SDK's decoder keeps the last event id (as the SSE spec says) and dispatches on every blank line
    # while one is set: a comment *block* after an id reaches it as an event with empty data.
    decoder = SSEDecoder()
    lines = ["id: r:1", 'data: {"a": 1}', "", ": keep-alive", ""]
    dispatched = [sse for line in lines if (sse := decoder.decode(line)) is not None]
    assert [(s.id, s.data) for s in dispatched] == [("r:1", '{"a": 1}'), ("r:1", "")]
    with pytest.raises(ValueError):
        dispatched[1].json()  # what Stream.__stream__ calls on every event
    decoder = SSEDecoder()
    lines = ["id: r:1", 'data: {"a": 1}', "", ": keep-alive", "id: r:2", 'data: {"b": 2}', ""]
    assert [s.data for line in lines if (s := decoder.decode(line)) is not None] == ['{"a": 1}', '{"b": 2}']


# -- errors after the first chunk --------------------------------------------------------


async def test_an_error_mid_stream_is_an_error_event_then_done() -> None:
    async with in_process_mesh(backend_settings={"delay": 0.01}, max_migrations=0) as mesh, gateway_over(mesh) as gw:
        for backend in mesh.backends:
            backend.fail_after = 3
        async with httpx.AsyncClient(base_url=gw.url) as http:
            response = await http.post("/completions", json={"prompt": "hi", "max_tokens": 10, "stream": True})
    assert response.status_code == 200
    payloads = datas(response.content)
    assert payloads[-1] == "[DONE]" and response.content.endswith(b"data: [DONE]\n\n")
    assert set(payloads[-2]) == {"error"} and set(payloads[-2]["error"]) == {"message", "type", "param", "code"}
    assert payloads[-2]["error"]["code"] == "unavailable"
    assert text_of(response.content) == tokens(3)


# -- resume ------------------------------------------------------------------------------------------


async def test_a_dropped_resumable_stream_resumes_with_last_event_id_exactly_the_rest() -> None:
    async with in_process_mesh(backend_settings={"delay": 0.02}) as mesh, gateway_over(mesh) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as http:
            body = {**CHAT, "max_tokens": 40, "stream": True}
            async with http.stream(
                "POST", "/chat/completions", json=body, headers={"X-Request-Id": "story"}
            ) as response:
                first = await Reader(response).events(5)
            first = first[: first.rindex(b"\n\n") + 2]  # what a client had whole when the connection dropped
            last_id = [e["id"] for e in events(first) if "id" in e][-1]
            await asyncio.sleep(0.1)
            assert len(running(mesh)) == 1  # detached, not cancelled: the worker keeps generating
            resumed = await http.get("/chat/completions/story/stream", headers={"Last-Event-ID": last_id})
            assert resumed.status_code == 200
            assert text_of(first) + text_of(resumed.content) == tokens(40)
            assert resumed.content.endswith(b"data: [DONE]\n\n")
            assert datas(resumed.content)[0]["choices"][0]["delta"]["role"] == "assistant"

            # The same generation again: whole (no Last-Event-ID), after seq 3 as a repeated POST with
            # Last-Event-ID, and with ?starting_after.
            whole = await http.get("/chat/completions/story/stream")
            assert text_of(whole.content) == tokens(40)
            again = await http.post(
                "/chat/completions",
                json={**body, "model": "fake"},
                headers={"X-Request-Id": "story", "Last-Event-ID": "story:3"},
            )
            assert text_of(again.content) == text_after(whole.content, 3)
            assert {d["model"] for d in datas(again.content)[:-1]} == {"fake"}
            assert text_after(whole.content, 3) != text_of(whole.content)
            seqs = [int(e["id"].rpartition(":")[2]) for e in events(whole.content) if "id" in e]
            tail = await http.get(f"/chat/completions/story/stream?starting_after={seqs[-2]}")
            assert text_of(tail.content) == text_after(whole.content, seqs[-2])
            # An EventSource that reconnects after [DONE] (its last id is the final seq): 416 at once, which
            # also stops its reconnecting, not a 503 after the client's retries.
            began = time.monotonic()
            done = await http.get("/chat/completions/story/stream", headers={"Last-Event-ID": f"story:{seqs[-1]}"})
            assert done.status_code == 416 and done.json()["error"]["code"] == "out_of_range"
            assert f"ended at seq {seqs[-1]}: nothing comes after it" in done.json()["error"]["message"]
            assert time.monotonic() - began < 2
        assert sum(len(b.started) for b in mesh.backends) == 1  # one generation, replayed


async def test_delete_cancels_a_detached_generation() -> None:
    async with in_process_mesh(backend_settings={"delay": 0.05}) as mesh, gateway_over(mesh) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as http:
            async with http.stream(
                "POST",
                "/completions",
                json={"prompt": "hi", "max_tokens": 500, "stream": True},
                headers={"X-Request-Id": "long-1"},
            ) as response:
                reader = Reader(response)
                await reader.events(2)
            await asyncio.sleep(0.1)
            assert len(running(mesh)) == 1
            deleted = await http.delete("/completions/long-1")
            assert deleted.status_code == 200
            assert deleted.json() == {"id": "cmpl-long-1", "object": "text_completion.deleted", "deleted": True}
            await wait_until(lambda: not running(mesh), timeout=2)
            gone = await http.delete("/completions/long-1")
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"
            unknown = await http.get("/chat/completions/never-was/stream")
            assert unknown.status_code == 404


# -- disconnects ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("silent", [False, True], ids=["tokens-flowing", "no-token-flowing"])
async def test_a_dropped_stream_without_request_id_cancels_its_generation_at_once(silent: bool) -> None:
    async with in_process_mesh(backend_settings={"delay": 0.02}) as mesh, gateway_over(mesh) as gw:
        for backend in mesh.backends:
            backend.stall_after = 3 if silent else None
        async with httpx.AsyncClient(base_url=gw.url) as http:
            async with http.stream(
                "POST", "/chat/completions", json={**CHAT, "max_tokens": 500, "stream": True}
            ) as response:
                reader = Reader(response)
                await reader.events(3)
                if silent:
                    await asyncio.sleep(0.2)  # the engine sends nothing now
                assert len(running(mesh)) == 1
                dropped = time.monotonic()
        await wait_until(lambda: not running(mesh), timeout=1)
        assert time.monotonic() - dropped < 1
        await wait_until(lambda: not mesh.router.inference.live.by_id, timeout=1)
        assert not gw.app.front.exchanges.active


async def test_a_non_streamed_request_whose_caller_leaves_is_cancelled() -> None:
    async with in_process_mesh(backend_settings={"delay": 0.05}) as mesh, gateway_over(mesh) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as http:
            request = asyncio.create_task(http.post("/completions", json={"prompt": "hi", "max_tokens": 500}))
            await wait_until(lambda: len(running(mesh)) == 1)
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
        await wait_until(lambda: not running(mesh), timeout=1)


# -- API keys and tenants ---------------------------------------------------------------------------


async def test_api_keys_are_required_and_name_the_tenant(mesh: InProcessMesh, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# team keys\n{hash_key('sk-search')} search\n{hash_key('sk-ads')} ads  # ads team\n")
    async with gateway_over(mesh, api_keys_file=str(keys)) as gw:
        anonymous = openai.AsyncOpenAI(base_url=gw.url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as refused:
            await anonymous.completions.create(model="fake", prompt="hi", max_tokens=2)
        assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
        async with httpx.AsyncClient(base_url=gw.url) as http:
            assert (await http.get("/models")).status_code == 401
            assert (await http.get("/models", headers={"Authorization": "Basic sk-search"})).status_code == 401
            assert (await http.get(gw.url.removesuffix("/v1") + "/health")).status_code == 200  # probes need none
        search = openai.AsyncOpenAI(base_url=gw.url, api_key="sk-search", max_retries=0)
        done = await search.completions.create(
            model="fake", prompt="hi", max_tokens=2, user="alice", extra_headers={"X-Request-Id": "q1"}
        )
        assert done.id == "cmpl-q1" and done.choices[0].text == tokens(2)
        params = [g.params for b in mesh.backends for g in b.started][-1]
        assert params.labels == {"tenant": "search", "user": "alice", "session": "alice"}  # user: the session too
        assert params.request_id == "search/q1"  # kept apart from other tenants' ids
        async with httpx.AsyncClient(base_url=gw.url) as http:
            other = await http.get("/completions/q1/stream", headers={"Authorization": "Bearer sk-ads"})
            assert other.status_code == 404  # another tenant's id is not found
            mine = await http.get("/completions/q1/stream", headers={"Authorization": "Bearer sk-search"})
            assert mine.status_code == 200 and text_of(mine.content) == tokens(2)


# -- drain -------------------------------------------------------------------------------------------------


async def test_shutdown_drains_then_ends_open_streams_with_an_error_event() -> None:
    async with in_process_mesh(backend_settings={"delay": 0.05}) as mesh:
        async with gateway_over(mesh, drain_grace_s=0.3) as gw:
            async with httpx.AsyncClient(base_url=gw.url) as http:
                async with http.stream(
                    "POST", "/completions", json={"prompt": "hi", "max_tokens": 500, "stream": True}
                ) as response:
                    reader = Reader(response)
                    await reader.events(2)
                    stopping = asyncio.create_task(gw.shutdown())
                    await wait_until(lambda: gw.app.front.draining)
                    health = await http.get(gw.url.removesuffix("/v1") + "/health")
                    assert health.status_code == 503 and health.json() == {"status": "draining"}
                    refused = await http.post("/completions", json={"prompt": "hi", "max_tokens": 2})
                    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
                    rest = await reader.rest()
                await stopping
        payloads = datas(rest)
        assert payloads[-1] == "[DONE]" and payloads[-2]["error"]["code"] == "unavailable"
        await wait_until(lambda: not running(mesh), timeout=2)  # its id was made up: cancelled


async def test_a_stream_next_to_bad_requests_is_untouched(mesh: InProcessMesh) -> None:
    for backend in mesh.backends:
        backend.delay = 0.01
    async with gateway_over(mesh, max_body_bytes=4096) as gw, httpx.AsyncClient(base_url=gw.url) as http:
        async with http.stream("POST", "/chat/completions", json={**CHAT, "max_tokens": 60, "stream": True}) as good:
            for bad in (
                b"{",
                b"\xff\xfe",
                orjson.dumps({"messages": []}),
                b"x" * 10_000,
                b"[1]",
                orjson.dumps({"messages": [{"role": "robot", "content": "hi"}]}),
            ):
                response = await http.post("/chat/completions", content=bad)
                assert 400 <= response.status_code < 500
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            raw = await good.aread()
        assert text_of(raw) == tokens(60) and raw.endswith(b"data: [DONE]\n\n")
        assert (await http.get(gw.url.removesuffix("/v1") + "/health")).status_code == 200


# -- tokenmesh bench --target openai -----------------------------------------------------------------


async def test_bench_drives_the_gateway_as_an_openai_endpoint(tmp_path: Path) -> None:
    from tests.support.bench import run_bench

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"prompt": "once"}\n')
    async with in_process_mesh() as mesh, gateway_over(mesh) as gw:
        report = tmp_path / "report.json"
        out = await run_bench(
            "--target",
            "openai",
            "--url",
            gw.url,
            "--requests",
            "10",
            "--concurrency",
            "3",
            "--output-tokens",
            "7",
            "--prompts",
            str(prompts),
            "--json",
            str(report),
        )
        unknown = await run_bench("--target", "openai", "--url", gw.url, "--model", "nope")
        started = [g.params for b in mesh.backends for g in b.started]
    assert out.returncode == 0, out.stderr
    summary = orjson.loads(report.read_bytes())["summaries"]["openai"]
    assert (summary["requests"], summary["successful"], summary["output_tokens"]) == (10, 10, 70)
    assert summary["errors"] == {} and summary["ttft_s"]["p50"] > 0
    assert {bool(p.messages) for p in started} == {True, False}  # chat and completions both
    assert all(p.ignore_eos and p.seed == 0 and p.max_tokens == 7 for p in started)
    assert unknown.returncode == 2 and "model 'nope' is not served at" in unknown.stderr
    down = await run_bench("--target", "openai", "--url", f"http://{dead_address()}/v1")
    assert down.returncode == 2 and "cannot reach" in down.stderr
    missing = await run_bench("--target", "openai")
    assert missing.returncode == 2 and "--target openai needs --url" in missing.stderr


async def test_the_bench_http_client_keeps_connections_and_retries_one_the_server_closed() -> None:
    from tokenmesh.bench.http1 import Http1Client, Http1Error

    served = 0

    async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        await reader.readuntil(b"\r\n\r\n")
        served += 1
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
        await writer.drain()
        writer.close()  # keep-alive by the headers, but the server closes it: the client must not reuse it blindly

    server = await asyncio.start_server(answer_once, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = Http1Client(f"http://127.0.0.1:{port}/v1")
    try:
        for _ in range(3):
            async with client.request("POST", "/x", b"{}") as response:
                assert response.status == 200 and await response.read() == b"abcde"
        assert served == 3

        # Several kept connections, all closed by the server meanwhile: each is tried, then a new one.
        async def one() -> bytes:
            async with client.request("POST", "/x", b"{}") as response:
                return await response.read()

        assert await asyncio.gather(*(one() for _ in range(4))) == [b"abcde"] * 4
        await asyncio.sleep(0.05)
        assert await one() == b"abcde" and served == 8
    finally:
        await client.close()
        server.close()
    with pytest.raises(Http1Error, match="cannot connect"):
        async with Http1Client(f"http://{dead_address()}").request("GET", "/"):
            pass

    async with in_process_mesh() as mesh, gateway_over(mesh) as gw:
        client = Http1Client(gw.url)
        try:
            for _ in range(3):
                async with client.request("GET", "/models") as response:
                    assert response.status == 200 and orjson.loads(await response.read())["object"] == "list"
                body = orjson.dumps({"prompt": "hi", "max_tokens": 3, "stream": True})
                async with client.request("POST", "/completions", body) as response:
                    assert response.headers["content-type"] == "text/event-stream"
                    assert text_of(await response.read()) == tokens(3)
            assert len(client._idle) == 1  # noqa: SLF001 - one connection carried all six
        finally:
            await client.close()


async def test_a_live_request_id_is_409_and_a_seq_beyond_the_stream_416() -> None:
    async with in_process_mesh(backend_settings={"delay": 0.02}) as mesh, gateway_over(mesh) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as http:
            body = {"prompt": "hi", "max_tokens": 100, "stream": True}
            async with http.stream("POST", "/completions", json=body, headers={"X-Request-Id": "twice"}) as first:
                reader = Reader(first)  # kept: the stream stays open
                await reader.events(2)
                again = await http.post("/completions", json=body, headers={"X-Request-Id": "twice"})
                assert again.status_code == 409 and again.json()["error"]["code"] == "already_exists"
            # Dropped: detached, resumable, but not after more than it sent.
            beyond = await http.get("/completions/twice/stream", headers={"Last-Event-ID": "twice:5000"})
            assert beyond.status_code == 416 and beyond.json()["error"]["code"] == "out_of_range"
            assert (await http.delete("/completions/twice")).status_code == 200
        await wait_until(lambda: not running(mesh), timeout=5)


async def test_a_fault_in_one_exchange_is_a_500_and_the_gateway_serves_on(
    mesh: InProcessMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with gateway_over(mesh) as gw, httpx.AsyncClient(base_url=gw.url) as http:
        assert gw.client is not None
        real = gw.client.generate

        async def broken(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
            raise RuntimeError("a bug")
            yield  # an async generator, as the real one

        monkeypatch.setattr(gw.client, "generate", broken)
        response = await http.post("/completions", json={"prompt": "hi", "max_tokens": 2})
        assert response.status_code == 500 and response.json()["error"]["code"] == "internal"
        monkeypatch.setattr(gw.client, "generate", real)
        response = await http.post("/completions", json={"prompt": "hi", "max_tokens": 2})
        assert response.status_code == 200
