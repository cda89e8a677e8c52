"""The bench's HTTP APIs: each one's request, and its SSE events read into a result the same way."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from tokenmesh.bench import apis
from tokenmesh.bench.metrics import RequestResult
from tokenmesh.bench.prompts import Prompt

RAW = Prompt(text="one two", max_tokens=5)
CHAT = Prompt(messages=(("system", "Be brief."), ("user", "hi")), max_tokens=5)


def body_of(api: str, prompt: Prompt, **options: Any) -> tuple[str, dict[str, Any]]:
    options = {"ignore_eos": True, "seed": 0, **options}
    path, raw = apis.request(api, prompt, "m", **options)
    return path, orjson.loads(raw)


def test_each_api_asks_for_the_same_generation_in_its_own_shape() -> None:
    assert body_of("completions", RAW) == (
        "/completions",
        {
            "model": "m",
            "stream": True,
            "prompt": "one two",
            "max_tokens": 5,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "seed": 0,
            "ignore_eos": True,
        },
    )
    path, chat = body_of("chat", RAW)
    assert path == "/chat/completions" and chat["messages"] == [{"role": "user", "content": "one two"}]
    assert (chat["max_tokens"], chat["seed"], chat["ignore_eos"]) == (5, 0, True)
    assert body_of("responses", RAW) == (
        "/responses",
        {"model": "m", "stream": True, "input": "one two", "max_output_tokens": 5, "ignore_eos": True},
    )
    assert body_of("responses", CHAT)[1]["input"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    # Anthropic's system prompt is a top-level field, not a message.
    assert body_of("messages", CHAT, ignore_eos=False, seed=None) == (
        "/messages",
        {
            "model": "m",
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "system": "Be brief.",
        },
    )
    assert [apis.resolve("auto", p) for p in (RAW, CHAT)] == ["completions", "chat"]
    assert apis.resolve("messages", RAW) == "messages"
    with pytest.raises(ValueError, match="--api completions takes raw prompts"):
        apis.request("completions", CHAT, "m", ignore_eos=True, seed=0)


class Body:
    """A response body that arrives in the given pieces (cut anywhere, as TCP may)."""

    def __init__(self, *pieces: bytes) -> None:
        self._pieces = pieces

    async def pieces(self) -> AsyncIterator[bytes]:
        for piece in self._pieces:
            yield piece


async def read(api: str, *pieces: bytes) -> RequestResult:
    result = RequestResult("openai", sent=0.0)
    ticks = iter(range(1, 1000))
    await apis.read(Body(*pieces), apis.READERS[api](result), lambda: float(next(ticks)))  # type: ignore[arg-type]
    return result


def cut(raw: bytes) -> tuple[bytes, ...]:
    """The body in 7-byte pieces: events split across reads."""
    return tuple(raw[i : i + 7] for i in range(0, len(raw), 7))


def sse(*events: tuple[str, dict[str, Any]]) -> bytes:
    return b"".join(
        (f"event: {name}\n".encode() if name else b"") + b"id: x:1\ndata: " + orjson.dumps(data) + b"\n\n"
        for name, data in events
    )


async def test_chat_counts_each_events_tokens_from_continuous_usage_and_ends_at_done() -> None:
    raw = sse(
        ("", {"choices": [{"delta": {"content": "a"}}], "usage": {"completion_tokens": 2}}),
        ("", {"choices": [{"delta": {"content": "b"}}], "usage": {"completion_tokens": 5}}),
        ("", {"choices": [{"delta": {}, "finish_reason": "length"}], "usage": {"completion_tokens": 5}}),
        ("", {"choices": [], "usage": {"completion_tokens": 5}}),
    )
    result = await read("chat", *cut(raw + b": keep-alive\ndata: [DONE]\n\n"))
    assert (result.chunk_tokens, result.output_tokens, result.error) == ([2, 3], 5, None)
    assert result.ended is not None and len(result.chunk_times) == 2


async def test_responses_count_one_token_a_delta_and_take_the_final_usage() -> None:
    deltas = [("response.output_text.delta", {"delta": t, "sequence_number": 4 + i}) for i, t in enumerate("abc")]
    end = ("response.incomplete", {"response": {"status": "incomplete", "usage": {"output_tokens": 9}}})
    opening = [("response.created", {"response": {}}), ("response.output_text.delta", {"delta": ""})]
    result = await read("responses", *cut(sse(*opening, *deltas, end)))
    assert (result.chunk_tokens, result.output_tokens, result.error) == ([1, 1, 1], 9, None)  # at max_output_tokens

    failed = ("response.failed", {"response": {"status": "failed", "error": {"code": "server_error"}}})
    assert (await read("responses", sse(deltas[0], failed))).error == "SERVER_ERROR"
    assert (await read("responses", sse(("error", {"code": "deadline_exceeded"})))).error == "DEADLINE_EXCEEDED"
    cancelled = ("response.incomplete", {"response": {"status": "cancelled", "error": None}})
    assert (await read("responses", sse(cancelled))).error == "CANCELLED"


async def test_messages_count_text_deltas_and_end_at_message_stop() -> None:
    raw = sse(
        ("message_start", {"message": {"usage": {"input_tokens": 0, "output_tokens": 0}}}),
        ("ping", {}),
        ("content_block_delta", {"delta": {"type": "text_delta", "text": "a"}}),
        ("content_block_delta", {"delta": {"type": "text_delta", "text": "b"}}),
        ("message_delta", {"usage": {"output_tokens": 6}}),
        ("message_stop", {}),
    )
    result = await read("messages", *cut(raw))
    assert (result.chunk_tokens, result.output_tokens, result.error) == ([1, 1], 6, None)
    overloaded = sse(("error", {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}))
    assert (await read("messages", overloaded)).error == "OVERLOADED_ERROR"


@pytest.mark.parametrize("api", apis.APIS)
async def test_a_body_that_ends_before_its_stream_is_no_end(api: str) -> None:
    result = await read(api, b"event: ping\ndata: {}\n\n")
    assert result.error == "NO_END" and result.ended is not None
