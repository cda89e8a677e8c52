"""The Responses API's pieces without a mesh: request checks, the events' sequence numbers, the store's bounds."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import pytest

from tokenmesh.errors import NotFound
from tokenmesh.v1 import inference_pb2
from tokenmesh_gateway import HttpError
from tokenmesh_gateway._response_store import Kept, ResponseStore, background_id, created_of
from tokenmesh_gateway._responses import Echo, parse
from tokenmesh_gateway._responses_sse import Head, ResponsesAnswer, ResponsesEncoder


def events_of(raw: bytes) -> list[dict[str, Any]]:
    """The data of each event, after checking that its event: line names its type."""
    found = []
    for block in raw.split(b"\n\n"):
        if not block:
            continue
        name, data = block.split(b"\n")
        event = orjson.loads(data.removeprefix(b"data: "))
        assert name == b"event: " + event["type"].encode()
        found.append(event)
    return found


def chunk(seq: int, text: str, reason: int = 0) -> inference_pb2.GenerateChunk:
    last = inference_pb2.GenerateChunk(request_id="r1", seq=seq, text=text, token_count=1, finish_reason=reason)
    if reason:
        last.usage.prompt_tokens, last.usage.completion_tokens = 5, seq
    return last


def stream(encoder: ResponsesEncoder, texts: list[str], reason: int) -> list[dict[str, Any]]:
    raw = b"".join(encoder.chunk(chunk(i + 1, text)) for i, text in enumerate(texts[:-1]))
    raw += encoder.last(chunk(len(texts), texts[-1], reason))
    return events_of(raw)


HEAD = Head("r1", 1_700_000_000, "fake", Echo(metadata={"k": "v"}))
TYPES_AROUND = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.mark.parametrize("final_text", ["c", ""], ids=["final-chunk-with-text", "final-chunk-empty"])
def test_sequence_numbers_are_contiguous_and_a_function_of_seq(final_text: str) -> None:
    events = stream(ResponsesEncoder(HEAD), ["a", "b", final_text], inference_pb2.FINISH_REASON_STOP)
    deltas = 3 if final_text else 2
    assert [e["type"] for e in events] == [
        *TYPES_AROUND,
        *["response.output_text.delta"] * deltas,
        *CLOSING,
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["sequence_number"] for e in events if e["type"].endswith(".delta")] == [3 + k for k in (1, 2, 3)][:deltas]
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["id"] == "resp_r1" and done["metadata"] == {"k": "v"}
    assert done["output"][0]["content"][0]["text"] == "ab" + final_text == events[-4]["text"]
    assert done["usage"] == {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 8,
    }


@pytest.mark.parametrize("after", [0, 3, 5, 8, 10, 11])
def test_starting_after_leaves_out_exactly_the_events_up_to_it(after: int) -> None:
    whole = stream(ResponsesEncoder(HEAD), ["a", "b", "c", "d"], inference_pb2.FINISH_REASON_LENGTH)
    rest = stream(ResponsesEncoder(HEAD, after), ["a", "b", "c", "d"], inference_pb2.FINISH_REASON_LENGTH)
    assert rest == [e for e in whole if e["sequence_number"] > after]
    assert whole[-1]["type"] == "response.incomplete"
    assert whole[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_cancelled_response_ends_incomplete_with_status_cancelled() -> None:
    events = stream(ResponsesEncoder(HEAD), ["a", ""], inference_pb2.FINISH_REASON_CANCELLED)
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "cancelled"


def test_input_forms_instructions_and_echo() -> None:
    parsed = parse(
        {
            "model": "m",
            "instructions": "be brief",
            "input": [
                {"role": "developer", "content": "sys"},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "yo"}]},
                {"role": "user", "content": "again"},
            ],
            "max_output_tokens": 9,
            "temperature": 0.5,
            "metadata": {"a": "b"},
            "background": True,
            "tools": [],
            "reasoning": None,
        }
    )
    request = parsed.request
    assert [(m.role, m.content) for m in request.messages] == [
        ("system", "be brief"),
        ("system", "sys"),
        ("user", "hi"),
        ("assistant", "yo"),
        ("user", "again"),
    ]
    assert request.max_tokens == 9 and request.temperature == 0.5
    assert parsed.echo == Echo("be brief", {"a": "b"}, 9, 0.5, None, True, True)
    assert [(m.role, m.content) for m in parse({"input": "hi"}).request.messages] == [("user", "hi")]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "previous_response_id": "resp_x"}, "previous_response_id"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "hi", "n": 2}, "n"),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"input": "hi", "text": {"verbosity": "low"}}, "text.verbosity"),
        ({"input": "hi", "truncation": "auto"}, "truncation"),
        ({"input": "hi", "background": True, "store": False}, "store"),
        ({"input": ""}, "input"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": "hi", "metadata": {"k": 1}}, "metadata.k"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_what_the_mesh_cannot_honour_is_refused_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(HttpError) as refused:
        parse(body)
    assert refused.value.status == 400 and refused.value.param == param


def test_a_background_id_says_when_it_was_made_and_nothing_else_looks_like_one() -> None:
    made = background_id(1_700_000_123)
    assert created_of(made) == 1_700_000_123
    assert created_of("bg-1-x") is None and created_of("my-request") is None


async def test_the_store_is_bounded_in_count_and_time() -> None:
    cancelled: list[str] = []

    async def cancel(mesh_id: str) -> object:
        cancelled.append(mesh_id)
        raise NotFound("gone")

    async def endless() -> Any:
        await asyncio.Event().wait()
        yield chunk(1, "x")  # pragma: no cover - never reached

    store = ResponseStore(retention_s=60, max_kept=2, cancel=cancel)
    now = int(time.time())
    first, second = Kept("a", Head("a", now, "m")), Kept("b", Head("b", now, "m"))
    for kept in (first, second):
        store.add(kept)
        kept.follow(endless())
    with pytest.raises(HttpError) as full:
        store.add(Kept("c", Head("c", now, "m")))
    assert full.value.status == 429  # both still run: nothing to make room with
    old = Kept("old", Head("old", now - 120, "m"))
    store.kept["old"] = old
    store.kept.move_to_end("old", last=False)
    old.follow(endless())
    assert store.get("old") is None  # past its retention: dropped and its generation cancelled
    await asyncio.sleep(0)
    assert cancelled == ["old"]
    await store.close()
    assert not store.kept and all(k.task is not None and k.task.cancelled() for k in (first, second, old))


def test_an_error_mid_stream_is_response_failed_numbered_after_the_last_event() -> None:
    answer = ResponsesAnswer(True, HEAD)
    encoder = answer.encoder("r1", "fake")
    raw = encoder.chunk(chunk(1, "a")) + encoder.chunk(chunk(2, "b"))
    raw += answer.error_event(HttpError(503, "no live worker", code="unavailable"))
    events = events_of(raw)
    assert [e["sequence_number"] for e in events] == list(range(7))
    failed = events[-1]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": "no live worker"}
    assert failed["response"]["output"][0]["content"][0]["text"] == "ab"
