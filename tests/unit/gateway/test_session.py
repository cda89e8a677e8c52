"""The session key each HTTP route takes, in its order, and the 400 for one the mesh would refuse."""

from __future__ import annotations

from typing import Any

import pytest

from tokenmesh.v1 import inference_pb2
from tokenmesh_gateway import HttpError, _anthropic, _openai, _responses, _session

USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> inference_pb2.GenerateRequest:
    return _openai.parse({"messages": USER, **fields}, "chat").request


def completion(**fields: Any) -> inference_pb2.GenerateRequest:
    return _openai.parse({"prompt": "hi", **fields}, "completion").request


def responses(**fields: Any) -> inference_pb2.GenerateRequest:
    return _responses.parse({"input": "hi", **fields}).request


def messages(**fields: Any) -> inference_pb2.GenerateRequest:
    return _anthropic.parse({"messages": USER, "max_tokens": 2, **fields}).request


@pytest.mark.parametrize("parse", [chat, completion, responses], ids=["chat", "completion", "responses"])
def test_prompt_cache_key_then_user_is_the_session_on_the_openai_routes(parse: Any) -> None:
    assert parse(prompt_cache_key="conv-1", user="alice").labels["session"] == "conv-1"
    assert parse(user="alice").labels["session"] == "alice"
    assert parse(prompt_cache_key="conv-1").labels["session"] == "conv-1"
    assert "session" not in parse().labels and "session" not in parse(prompt_cache_key="", user=None).labels


def test_the_responses_safety_identifier_is_no_session_key() -> None:
    request = responses(safety_identifier="hashed-user")
    assert dict(request.labels) == {"user": "hashed-user"}  # OpenAI's own: for abuse checks, not for caching


def test_metadata_user_id_is_the_session_on_anthropic_messages() -> None:
    assert messages(metadata={"user_id": "alice"}).labels["session"] == "alice"
    assert "session" not in messages().labels


def test_the_x_session_id_header_wins_over_the_body() -> None:
    for request in (chat(prompt_cache_key="conv-1", user="alice"), messages(metadata={"user_id": "alice"})):
        _session.from_header({"headers": [(b"x-session-id", b"from-header")]}, request)
        assert request.labels["session"] == "from-header"
    request = chat(prompt_cache_key="conv-1")
    _session.from_header({"headers": [(b"x-session-id", b"")]}, request)  # an empty header names no session
    assert request.labels["session"] == "conv-1"


@pytest.mark.parametrize(
    ("build", "param"),
    [
        (lambda v: chat(prompt_cache_key=v), "prompt_cache_key"),
        (lambda v: completion(user=v), "user"),
        (lambda v: responses(prompt_cache_key=v), "prompt_cache_key"),
        (lambda v: messages(metadata={"user_id": v}), "metadata.user_id"),
        (lambda v: _session.from_header({"headers": [(b"x-session-id", v.encode())]}, chat()), "X-Session-ID"),
    ],
    ids=["chat-prompt-cache-key", "completion-user", "responses-prompt-cache-key", "messages-user-id", "header"],
)
def test_a_session_key_the_mesh_would_refuse_is_a_400_naming_where_it_came_from(build: Any, param: str) -> None:
    for bad in ("k" * 257, "tab\tinside"):
        with pytest.raises(HttpError) as refused:
            build(bad)
        assert (refused.value.status, refused.value.param) == (400, param)
        assert "at most 256 printable characters" in refused.value.message
    build("k" * 256)  # the longest label value the mesh takes
    with pytest.raises(HttpError) as wrong_type:
        chat(prompt_cache_key=7)
    assert wrong_type.value.param == "prompt_cache_key"
