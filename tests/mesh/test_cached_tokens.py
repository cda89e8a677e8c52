"""Cached prompt tokens, from the engine's figure to every API's usage: gRPC, chat, completions, Responses, Messages.

The fake engine reports what a test sets (a real engine's figure: tests/integration/test_gateway.py on SmolLM2);
these check that the figure travels the worker, the router and the gateway unchanged, into each API's own field.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.support.gateway_helpers import datas, gateway_over
from tests.support.mesh import InProcessMesh, collect, in_process_mesh

PROMPT_TOKENS = 3
"""What the fake engine counts for a prompt without "tok" in it."""
CACHED = 2
USER: list[Any] = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def cached_mesh() -> AsyncIterator[InProcessMesh]:
    """The in-process mesh whose engines say they reused CACHED of each prompt's tokens."""
    async with in_process_mesh() as mesh:
        for backend in mesh.backends:
            backend.cached_prompt_tokens = CACHED
        yield mesh


async def test_the_routers_final_chunk_carries_the_engines_figure_and_only_the_final(
    cached_mesh: InProcessMesh,
) -> None:
    streams = await asyncio.gather(*(collect(cached_mesh, model="fake", prompt="hi", max_tokens=5) for _ in range(24)))
    for chunks in streams:
        assert [c.usage.cached_prompt_tokens for c in chunks] == [0] * (len(chunks) - 1) + [CACHED]
        assert chunks[-1].usage.prompt_tokens == PROMPT_TOKENS


async def test_a_figure_above_the_prompt_is_capped_at_the_prompt(cached_mesh: InProcessMesh) -> None:
    # An engine's cache holds a prefix of what it was given; of the caller's prompt it cannot have reused more.
    for backend in cached_mesh.backends:
        backend.cached_prompt_tokens = 50
    chunks = await collect(cached_mesh, model="fake", prompt="hi", max_tokens=3)
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.cached_prompt_tokens) == (PROMPT_TOKENS, PROMPT_TOKENS)


async def test_openai_chat_and_completions_report_prompt_tokens_details_streamed_and_whole(
    cached_mesh: InProcessMesh,
) -> None:
    async with gateway_over(cached_mesh) as gateway:
        client = openai.AsyncOpenAI(base_url=gateway.url, api_key="x", max_retries=0)
        stream = await client.chat.completions.create(
            model="fake", messages=USER, max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        assert (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens) == (PROMPT_TOKENS, CACHED)

        whole = await client.chat.completions.create(model="fake", messages=USER, max_tokens=4)
        assert whole.usage is not None and whole.usage.prompt_tokens_details is not None
        assert whole.usage.prompt_tokens_details.cached_tokens == CACHED

        text = await client.completions.create(model="fake", prompt="hi", max_tokens=4)
        assert text.usage is not None and text.usage.prompt_tokens_details is not None
        assert text.usage.prompt_tokens_details.cached_tokens == CACHED


async def test_continuous_usage_has_the_details_on_the_final_event_only(cached_mesh: InProcessMesh) -> None:
    # Before the end the mesh has no prompt figure: those events say nothing about the prompt's cache either.
    body = {
        "model": "fake",
        "prompt": "hi",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    async with gateway_over(cached_mesh) as gateway, httpx.AsyncClient(base_url=gateway.url) as http:
        raw = (await http.post("/completions", json=body)).content
    usages = [d["usage"] for d in datas(raw) if isinstance(d, dict)]
    # Every token event, then the finish event and the usage event (both with the prompt's figures).
    assert [u["completion_tokens"] for u in usages] == [1, 2, 3, 3, 3]
    assert ["prompt_tokens_details" in u for u in usages] == [False, False, False, True, True]
    assert usages[-1] == {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": 3,
        "total_tokens": PROMPT_TOKENS + 3,
        "prompt_tokens_details": {"cached_tokens": CACHED},
    }


async def test_responses_report_input_tokens_details_streamed_and_whole(cached_mesh: InProcessMesh) -> None:
    async with gateway_over(cached_mesh) as gateway:
        client = openai.AsyncOpenAI(base_url=gateway.url, api_key="x", max_retries=0)
        response = await client.responses.create(model="fake", input="hi", max_output_tokens=4)
        assert response.usage is not None
        assert (response.usage.input_tokens, response.usage.input_tokens_details.cached_tokens) == (
            PROMPT_TOKENS,
            CACHED,
        )
        stream = await client.responses.create(model="fake", input="hi", max_output_tokens=4, stream=True)
        events = [e async for e in stream]
        final = events[-1].response
        assert final.usage is not None and final.usage.input_tokens_details.cached_tokens == CACHED


async def test_messages_report_cache_read_input_tokens_apart_from_input_tokens(cached_mesh: InProcessMesh) -> None:
    # Anthropic's input_tokens are the prompt's tokens read from no cache: the three parts add up to the prompt.
    async with gateway_over(cached_mesh) as gateway:
        client = anthropic.AsyncAnthropic(base_url=gateway.url.removesuffix("/v1"), api_key="x", max_retries=0)
        message = await client.messages.create(model="fake", max_tokens=4, messages=USER)
        async with client.messages.stream(model="fake", max_tokens=4, messages=USER) as stream:
            final = await stream.get_final_message()
    for usage in (message.usage, final.usage):
        assert (usage.input_tokens, usage.cache_read_input_tokens) == (PROMPT_TOKENS - CACHED, CACHED)
        assert usage.cache_creation_input_tokens is None  # the engine reports no such figure: none is made up


async def test_a_cache_that_reused_nothing_reports_zero_in_every_api(mesh: InProcessMesh) -> None:
    async with gateway_over(mesh) as gateway, httpx.AsyncClient(base_url=gateway.url) as http:
        chat = (await http.post("/chat/completions", json={"model": "fake", "messages": USER, "max_tokens": 2})).json()
        responses = (await http.post("/responses", json={"model": "fake", "input": "hi"})).json()
        message = await http.post("/messages", json={"model": "fake", "max_tokens": 2, "messages": USER})
    assert chat["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert responses["usage"]["input_tokens_details"] == {"cached_tokens": 0}
    usage = message.json()["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (PROMPT_TOKENS, 0)
