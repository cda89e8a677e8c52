"""The wire format: OpenAI chunks as Server-Sent Events, and the non-streamed bodies.

Each chunk of the mesh becomes the events built from it, written at once:
one choice event (the role in the first delta of a response; the
finish_reason on the last), then the usage event (``choices: []``) when the
caller asked for it. The last event of a chunk carries
``id: <request_id>:<seq>``, so a caller that saw an id has every event of
that chunk, and ``Last-Event-ID`` resumes right after it. The stream ends
with exactly ``data: [DONE]``.

Per token, only the text is JSON-encoded: the rest of each event is bytes
prepared once per response.

Keep-alive is the comment line ``: keep-alive`` with no blank line after
it. The ``openai`` SDK's decoder (``SSEDecoder.decode``) keeps the last event
id, as the SSE spec says, and dispatches an event on every blank line while
an id is set: a comment followed by a blank line after the first ``id:``
would reach the SDK as an event with empty data, which it fails to parse as
JSON. A lone comment line is skipped by every SSE parser and dispatches
nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from tokenmesh.v1 import inference_pb2
from tokenmesh_gateway._errors import OPENAI_ERRORS, ErrorShape, HttpError
from tokenmesh_gateway._openai import Kind

DONE = b"data: [DONE]\n\n"

FINISH_REASONS: dict[int, str] = {
    inference_pb2.FINISH_REASON_STOP: "stop",
    inference_pb2.FINISH_REASON_LENGTH: "length",
    inference_pb2.FINISH_REASON_CANCELLED: "abort",  # vLLM's name for a generation stopped by a cancel
}

_PREFIX = {"chat": "chatcmpl-", "completion": "cmpl-"}
_OBJECT = {"chat": "chat.completion", "completion": "text_completion"}
_CHUNK_OBJECT = {"chat": "chat.completion.chunk", "completion": "text_completion"}


def response_id(kind: Kind, request_id: str) -> str:
    """The OpenAI ``id`` of a generation's response: ``chatcmpl-<request_id>`` or ``cmpl-<request_id>``."""
    return _PREFIX[kind] + request_id


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` once the prompt is counted (the end).

    Args:
        prompt_tokens: the prompt's tokens (0 before the end: the mesh counts them when the generation ends).
        completion_tokens: tokens generated so far.
        cached_tokens: of prompt_tokens, those the engine reused from its cache; None leaves the details out
            (a continuous-usage event before the end, where no prompt figure exists yet).

    """
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def whole_usage(counts: inference_pb2.Usage) -> dict[str, Any]:
    """OpenAI's usage object of a finished generation, from the mesh's."""
    return usage(counts.prompt_tokens, counts.completion_tokens, counts.cached_prompt_tokens)


@dataclass(frozen=True, slots=True)
class OpenAIAnswer:
    """How to answer one chat or completion request (``_stream.Answer`` in OpenAI's format)."""

    kind: Kind
    stream: bool
    include_usage: bool
    continuous_usage: bool
    model: str
    """The model to name when the mesh's chunks name none."""
    created: int
    """The response's ``created``."""
    id_prefix: str = ""
    """What the mesh's request ids carry in front of the caller's (its tenant); the caller never sees it."""
    errors: ErrorShape = OPENAI_ERRORS

    def encoder(self, request_id: str, model: str) -> Encoder:
        """The SSE events of the response."""
        return Encoder(
            self.kind,
            request_id,
            self.created,
            model or self.model,
            include_usage=self.include_usage,
            continuous_usage=self.continuous_usage,
        )

    def whole(self, request_id: str, text: str, last: inference_pb2.GenerateChunk) -> bytes:
        """The ``chat.completion`` or ``text_completion`` body."""
        return completion_body(self.kind, request_id, self.created, last.model or self.model, text, last)

    def error_event(self, error: HttpError) -> bytes:
        """``data: {"error": {...}}``, then ``[DONE]``."""
        return error_event(error)


class Encoder:
    """The SSE events of one response: constant id, created and model.

    Args:
        kind: chat (``chat.completion.chunk``) or completion (``text_completion``).
        request_id: the generation's id (the events' ``id:`` and the response ``id``).
        created: the response's ``created`` (Unix seconds).
        model: the model that serves it.
        include_usage: end with a usage event (``choices: []``).
        continuous_usage: the usage so far on every choice event (the prompt's tokens are known at the end only).

    """

    kind: Kind
    request_id: str
    include_usage: bool
    continuous_usage: bool
    completion_tokens: int
    """Tokens sent so far (continuous usage)."""
    _head: bytes
    _first: bool
    _id_line: bytes
    _text_head: bytes
    _text_tail: bytes

    def __init__(
        self,
        kind: Kind,
        request_id: str,
        created: int,
        model: str,
        *,
        include_usage: bool = False,
        continuous_usage: bool = False,
    ) -> None:
        self.kind = kind
        self.request_id = request_id
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.completion_tokens = 0
        head = {"id": response_id(kind, request_id), "object": _CHUNK_OBJECT[kind], "created": created, "model": model}
        # '{"id":...,"model":"m"' without the closing brace: each event appends its own fields.
        self._head = b"data: " + orjson.dumps(head)[:-1]
        self._first = True
        self._offset = 0
        """Characters of text sent so far (completions' logprobs ``text_offset``)."""
        self._id_line = b"id: " + orjson.dumps(request_id)[1:-1] + b":"
        # Most events: a text delta, not the first, not the last, no usage. All of it but the text is fixed.
        opening = b'{"index":0,"delta":{"content":' if kind == "chat" else b'{"index":0,"text":'
        closing = (
            b'},"logprobs":null,"finish_reason":null}]}\n\n'
            if kind == "chat"
            else b',"logprobs":null,"finish_reason":null}]}\n\n'
        )
        self._text_head = b"\n" + self._head + b',"choices":[' + opening
        self._text_tail = closing

    def chunk(self, chunk: inference_pb2.GenerateChunk) -> bytes:
        """Every event built from one chunk of the mesh, the id on the last."""
        self.completion_tokens += chunk.token_count
        final = bool(chunk.finish_reason)
        logprobs = b"null"
        if chunk.logprobs:
            logprobs = orjson.dumps(logprobs_json(self.kind, chunk.logprobs, self._offset))
        self._offset += len(chunk.text)
        if not (final or self._first or self.continuous_usage or chunk.logprobs):
            return (
                self._id_line + str(chunk.seq).encode() + self._text_head + orjson.dumps(chunk.text) + self._text_tail
            )
        reason = b"null"
        if final:
            reason = b'"' + FINISH_REASONS.get(chunk.finish_reason, "stop").encode() + b'"'
        text = orjson.dumps(chunk.text)
        if self.kind == "chat":
            parts = []
            if self._first:
                parts.append(b'"role":"assistant"')
            if chunk.text or self._first:
                parts.append(b'"content":' + text)
            choice = (
                b'{"index":0,"delta":{' + b",".join(parts) + b'},"logprobs":' + logprobs + b',"finish_reason":' + reason
            )
        else:
            choice = b'{"index":0,"text":' + text + b',"logprobs":' + logprobs + b',"finish_reason":' + reason
        choice += b"}"
        self._first = False
        tail = b""
        if self.continuous_usage:
            counts = chunk.usage
            if final:
                so_far = usage(counts.prompt_tokens, self.completion_tokens, counts.cached_prompt_tokens)
            else:
                so_far = usage(0, self.completion_tokens)
            tail = b',"usage":' + orjson.dumps(so_far)
        event = self._head + b',"choices":[' + choice + b"]" + tail + b"}\n"
        if final and self.include_usage:
            last = self._head + b',"choices":[],"usage":' + orjson.dumps(whole_usage(chunk.usage)) + b"}\n"
            return event + b"\n" + self._id(chunk.seq) + last + b"\n"
        return self._id(chunk.seq) + event + b"\n"

    def last(self, chunk: inference_pb2.GenerateChunk) -> bytes:
        """The final chunk's events, then ``[DONE]``."""
        return self.chunk(chunk) + DONE

    def _id(self, seq: int) -> bytes:
        return self._id_line + str(seq).encode() + b"\n"


def logprobs_json(kind: Kind, tokens: Iterable[inference_pb2.TokenLogprob], offset: int) -> dict[str, Any]:
    """A choice's ``logprobs`` in OpenAI's shape: chat's ``content`` list, or completions' columns.

    offset is where the tokens' text starts in the completion (completions' ``text_offset``).
    """
    if kind == "chat":
        return {
            "content": [
                {
                    "token": t.token,
                    "logprob": t.logprob,
                    "bytes": list(t.bytes),
                    "top_logprobs": [
                        {"token": a.token, "logprob": a.logprob, "bytes": list(a.bytes)} for a in t.top_logprobs
                    ],
                }
                for t in tokens
            ],
            "refusal": None,
        }
    columns: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        columns["tokens"].append(t.token)
        columns["token_logprobs"].append(t.logprob)
        columns["top_logprobs"].append({a.token: a.logprob for a in t.top_logprobs})
        columns["text_offset"].append(offset)
        offset += len(t.token)
    return columns


def error_event(error: HttpError) -> bytes:
    """An error after the stream began: ``data: {"error": {...}}``, then the end."""
    return b"data: " + error.body() + b"\n\n" + DONE


def completion_body(
    kind: Kind, request_id: str, created: int, model: str, text: str, last: inference_pb2.GenerateChunk
) -> bytes:
    """The non-streamed response: ``chat.completion`` or ``text_completion`` with its usage.

    last is the final chunk; with logprobs it carries every token's (the exchange gathers them there).
    """
    reason = FINISH_REASONS.get(last.finish_reason, "stop")
    counts = last.usage
    logprobs = logprobs_json(kind, last.logprobs, 0) if last.logprobs else None
    choice: dict[str, Any]
    if kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": reason,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
    return orjson.dumps(
        {
            "id": response_id(kind, request_id),
            "object": _OBJECT[kind],
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": whole_usage(counts),
        }
    )
