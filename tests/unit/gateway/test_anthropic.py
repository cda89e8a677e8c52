"""Anthropic Messages: the request's translation, the events and bodies of each ending, the error shape."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from tokenmesh.v1 import inference_pb2
from tokenmesh_gateway import HttpError
from tokenmesh_gateway._anthropic import parse
from tokenmesh_gateway._anthropic_sse import ANTHROPIC_ERRORS, MessagesAnswer

USER = [{"role": "user", "content": "hi"}]


def chunk(text: str, finish: int = 0, seq: int = 1, usage: tuple[int, int] = (0, 0)) -> inference_pb2.GenerateChunk:
    return inference_pb2.GenerateChunk(
        request_id="t/r1",
        seq=seq,
        text=text,
        token_count=1,
        finish_reason=finish,  # type: ignore[arg-type]
        usage=inference_pb2.Usage(prompt_tokens=usage[0], completion_tokens=usage[1]),
        model="m",
    )


def events(raw: bytes) -> list[tuple[str, Any]]:
    """(name, data) of each event; an id only on the events that can end a chunk."""
    out = []
    for block in raw.split(b"\n\n"):
        if block:
            fields = dict(line.split(b": ", 1) for line in block.split(b"\n"))
            name = fields[b"event"].decode()
            assert b"id" not in fields or name in ("content_block_delta", "message_stop"), block
            out.append((name, orjson.loads(fields[b"data"])))
    return out


def ids(raw: bytes) -> list[str]:
    return [line.removeprefix(b"id: ").decode() for line in raw.split(b"\n") if line.startswith(b"id: ")]


def test_a_messages_body_becomes_the_mesh_request() -> None:
    parsed = parse(
        {
            "model": "m",
            "system": "Be brief.",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}]},
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"},
            ],
            "max_tokens": 9,
            "temperature": 0,
            "stop_sequences": ["END", ""],
            "metadata": {"user_id": "u1"},
            "service_tier": "auto",
            "tools": [],
            "stream": True,
        }
    )
    request = parsed.request
    assert parsed.stream
    assert [(m.role, m.content) for m in request.messages] == [
        ("system", "Be brief."),
        ("user", "a"),
        ("assistant", "b"),
        ("user", "c"),
    ]
    assert (request.model, request.max_tokens, request.temperature, list(request.stop)) == ("m", 9, 0.0, ["END"])
    assert request.HasField("temperature") and not request.HasField("top_p")
    assert dict(request.labels) == {"user": "u1", "session": "u1"}
    assert parse({"messages": USER, "max_tokens": 1}, default_model="d").request.model == "d"
    assert not request.ignore_eos
    assert parse({"messages": USER, "max_tokens": 1, "ignore_eos": True}).request.ignore_eos  # the OpenAI routes' too


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"top_k": "many"}, "top_k"),
        ({"system": [{"type": "image"}]}, "system[0]"),
        ({"stream": "yes"}, "stream"),
        ({"stop_sequences": "END"}, "stop_sequences"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "citations": [{}]}]}]},
            "messages[0].content[0].citations",
        ),
    ],
)
def test_a_field_the_mesh_cannot_honour_is_refused_naming_it(extra: dict[str, Any], field: str) -> None:
    with pytest.raises(HttpError) as refused:
        parse({"messages": USER, "max_tokens": 5, **extra})
    assert (refused.value.status, refused.value.param) == (400, field)


def test_each_ending_of_a_stream_in_anthropics_events() -> None:
    answer = MessagesAnswer(stream=True, model="fallback", id_prefix="t/")
    encoder = answer.encoder("r1", "")
    raw = encoder.chunk(chunk("Hel")) + encoder.chunk(chunk("lo", seq=2))
    raw += encoder.last(chunk("!", inference_pb2.FINISH_REASON_STOP, 3, (4, 3)))
    got = events(raw)
    assert [name for name, _ in got] == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert got[0][1]["message"]["id"] == "msg_r1" and got[0][1]["message"]["model"] == "fallback"
    assert "".join(data["delta"]["text"] for name, data in got if name == "content_block_delta") == "Hello!"
    assert got[7][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert got[7][1]["usage"] == {"input_tokens": 4, "cache_read_input_tokens": 0, "output_tokens": 3}
    assert ids(raw) == ["r1:1", "r1:2", "r1:3"]  # the last event of each chunk: the final delta has none of its own

    # Resumed after seq 1: no opening events, the rest with their ids.
    resumed = MessagesAnswer(stream=True, model="m", after=1).encoder("r1", "m")
    rest = resumed.chunk(chunk("lo", seq=2)) + resumed.last(chunk("!", inference_pb2.FINISH_REASON_STOP, 3, (4, 3)))
    assert [name for name, _ in events(rest)] == [
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert ids(rest) == ["r1:2", "r1:3"]

    # A generation whose first chunk is its last still opens the message; a cancelled one ends in an error event.
    only = events(answer.encoder("r2", "m").last(chunk("", inference_pb2.FINISH_REASON_LENGTH, 1, (4, 0))))
    assert [name for name, _ in only][:3] == ["message_start", "content_block_start", "ping"]
    assert only[-2][1]["delta"]["stop_reason"] == "max_tokens"
    cancelled = events(answer.encoder("r3", "m").last(chunk("", inference_pb2.FINISH_REASON_CANCELLED, 1)))
    assert cancelled[-1] == (
        "error",
        {
            "type": "error",
            "error": {
                "type": "invalid_request_error",
                "message": "generation r3 was cancelled (Cancel with its request id)",
            },
        },
    )


def test_the_whole_message_and_its_stop_reasons() -> None:
    answer = MessagesAnswer(stream=False, model="m")
    body = orjson.loads(answer.whole("r1", "Paris.", chunk("", inference_pb2.FINISH_REASON_STOP, 2, (7, 3))))
    assert body == {
        "id": "msg_r1",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": "Paris."}],
        "model": "m",
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 7, "cache_read_input_tokens": 0, "output_tokens": 3},
    }
    length = orjson.loads(answer.whole("r1", "x", chunk("", inference_pb2.FINISH_REASON_LENGTH)))
    assert length["stop_reason"] == "max_tokens"
    with pytest.raises(HttpError) as cancelled:
        answer.whole("r1", "x", chunk("", inference_pb2.FINISH_REASON_CANCELLED))
    assert cancelled.value.status == 499


@pytest.mark.parametrize(
    ("status", "answered", "kind"),
    [
        (400, 400, "invalid_request_error"),
        (401, 401, "authentication_error"),
        (403, 403, "permission_error"),
        (404, 404, "not_found_error"),
        (409, 409, "invalid_request_error"),
        (413, 413, "request_too_large"),
        (429, 429, "rate_limit_error"),
        (500, 500, "api_error"),
        (503, 529, "overloaded_error"),
        (504, 504, "api_error"),
    ],
)
def test_the_error_shape_per_status(status: int, answered: int, kind: str) -> None:
    error = HttpError(status, "max_tokens must be 1..512", param="max_tokens", retry_after_ms=1500)
    assert ANTHROPIC_ERRORS.status(error) == answered
    assert orjson.loads(ANTHROPIC_ERRORS.body(error)) == {
        "type": "error",
        "error": {"type": kind, "message": "max_tokens must be 1..512"},
    }
    assert error.headers() == [(b"retry-after", b"2"), (b"retry-after-ms", b"1500")]
    named = orjson.loads(ANTHROPIC_ERRORS.body(HttpError(400, "is required", param="max_tokens")))
    assert named["error"]["message"] == "max_tokens: is required"
