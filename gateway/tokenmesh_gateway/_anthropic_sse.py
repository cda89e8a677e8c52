"""Anthropic's wire format: the Messages stream's named SSE events, the Message body and the error shape.

A stream is ``message_start``, ``content_block_start`` (one text block),
``ping``, a ``content_block_delta`` (``text_delta``) per chunk of the mesh,
then ``content_block_stop``, ``message_delta`` (``stop_reason`` and the
usage) and ``message_stop``; the last event of each chunk carries
``id: <request_id>:<seq>``, so ``Last-Event-ID`` resumes it as on the OpenAI
routes (a resumed stream has no opening events). The mesh counts the prompt's tokens only when
the generation ends, so ``message_start`` carries ``input_tokens: 0`` and
``message_delta`` the real ``input_tokens`` with ``output_tokens`` (its
counts are totals, which the ``anthropic`` SDK takes over the start's).

``stop_reason`` is ``end_turn`` or ``max_tokens``: the mesh's ``stop`` does not
say whether the model's end-of-turn or a stop sequence ended the answer, so
``stop_sequence`` is never reported (``stop_sequence`` stays null). A
generation cancelled by ``Cancel`` (its ``X-Request-Id``) is no answer: 499,
or an ``error`` event mid-stream.

Errors are ``{"type": "error", "error": {"type", "message"}}``: the status of
the mesh's error table, except that 503 (no worker can take it now, a
draining gateway) is Anthropic's 529 ``overloaded_error``; 429 (the router's
admission refused it) stays ``rate_limit_error`` with ``retry-after``.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from tokenmesh.v1 import inference_pb2
from tokenmesh_gateway._errors import HttpError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
"""Anthropic's error ``type`` per status; any other 4xx is an invalid request, any other 5xx an api_error."""

OVERLOADED = 529

STOP_REASONS: dict[int, str] = {
    inference_pb2.FINISH_REASON_STOP: "end_turn",
    inference_pb2.FINISH_REASON_LENGTH: "max_tokens",
}


class AnthropicErrors:
    """Anthropic's error shape (``_errors.ErrorShape``)."""

    def status(self, error: HttpError) -> int:
        """The error's status; 503 is 529 (overloaded: the SDK retries it, after ``retry-after``)."""
        return OVERLOADED if error.status == 503 else error.status

    def body(self, error: HttpError) -> bytes:
        """``{"type": "error", "error": {"type", "message"}}``; the message starts with the field at fault, if any.

        Anthropic's error has no ``param``: its messages name the field first (``max_tokens: Field required``).
        """
        message = error.message
        if error.param and not message.startswith(error.param):
            message = f"{error.param}: {message}"
        return orjson.dumps({"type": "error", "error": {"type": error_type(self.status(error)), "message": message}})


ANTHROPIC_ERRORS = AnthropicErrors()


def error_type(status: int) -> str:
    """Anthropic's error type of an HTTP status."""
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def message_id(request_id: str) -> str:
    """The Message's ``id``: ``msg_<request_id>``."""
    return "msg_" + request_id


def usage(counts: inference_pb2.Usage) -> dict[str, int]:
    """Anthropic's usage of a finished generation: ``input_tokens`` are the prompt's tokens read from no cache.

    Anthropic counts a prompt's tokens in three parts that add up to it: ``input_tokens`` (computed),
    ``cache_read_input_tokens`` (reused from its cache) and ``cache_creation_input_tokens`` (written to a cache
    at a ``cache_control`` breakpoint). The mesh's engine caches every prompt by itself, with no breakpoints, and
    says only what it reused: the third part is left out (no such figure), never reported as a guess.
    """
    cached = min(counts.cached_prompt_tokens, counts.prompt_tokens)
    return {
        "input_tokens": counts.prompt_tokens - cached,
        "cache_read_input_tokens": cached,
        "output_tokens": counts.completion_tokens,
    }


def _cancelled(request_id: str) -> HttpError:
    return HttpError(499, f"generation {request_id} was cancelled (Cancel with its request id)", code="cancelled")


def _event(name: bytes, data: bytes) -> bytes:
    return b"event: " + name + b"\ndata: " + data + b"\n\n"


@dataclass(frozen=True, slots=True)
class MessagesAnswer:
    """How to answer one Messages request (``_stream.Answer`` in Anthropic's format)."""

    stream: bool
    model: str
    """The model to name when the mesh's chunks name none."""
    id_prefix: str = ""
    """What the mesh's request ids carry in front of the caller's (its tenant); the caller never sees it."""
    after: int = 0
    """The seq a resumed stream starts after (``Last-Event-ID``); 0: the whole stream, its opening events too."""
    errors: AnthropicErrors = ANTHROPIC_ERRORS

    def encoder(self, request_id: str, model: str) -> MessagesEncoder:
        """The named events of the stream."""
        return MessagesEncoder(request_id, model or self.model, resumed=self.after > 0)

    def whole(self, request_id: str, text: str, last: inference_pb2.GenerateChunk) -> bytes:
        """The Message object; 499 for a cancelled generation."""
        reason = STOP_REASONS.get(last.finish_reason)
        if reason is None:
            raise _cancelled(request_id)
        return orjson.dumps(
            {
                "id": message_id(request_id),
                "type": "message",
                "role": "assistant",
                "content": [{"type": "text", "text": text}],
                "model": last.model or self.model,
                "stop_reason": reason,
                "stop_sequence": None,
                "usage": usage(last.usage),
            }
        )

    def error_event(self, error: HttpError) -> bytes:
        """``event: error`` with the error's body: the end of the stream."""
        return _event(b"error", self.errors.body(error))


class MessagesEncoder:
    """The named SSE events of one Message stream.

    The last event of each chunk carries ``id: <request_id>:<seq>``, as on
    the OpenAI routes: ``Last-Event-ID`` on a repeated POST resumes right
    after it.

    Args:
        request_id: the generation's id (the Message's ``id`` is ``msg_<request_id>``).
        model: the model that serves it.
        resumed: the stream continues one the caller has seen the start of (no opening events).

    """

    request_id: str
    opened: bool
    """message_start, content_block_start and ping are sent (or were, before a resume)."""
    _start: bytes
    _id_line: bytes

    def __init__(self, request_id: str, model: str, *, resumed: bool = False) -> None:
        self.request_id = request_id
        self.opened = resumed
        self._id_line = b"id: " + orjson.dumps(request_id)[1:-1] + b":"
        message: dict[str, object] = {
            "id": message_id(request_id),
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        self._start = (
            _event(b"message_start", orjson.dumps({"type": "message_start", "message": message}))
            + _event(
                b"content_block_start",
                b'{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}',
            )
            + _event(b"ping", b'{"type":"ping"}')
        )

    def chunk(self, chunk: inference_pb2.GenerateChunk) -> bytes:
        """A text delta with the chunk's id (after the opening events, on the first chunk)."""
        # The hot path: only the text is JSON-encoded, the rest is bytes made once per stream.
        delta = self._id_line + str(chunk.seq).encode() + b"\n" + _DELTA_HEAD + orjson.dumps(chunk.text) + b"}}\n\n"
        if self.opened:
            return delta
        self.opened = True
        return self._start + delta

    def last(self, chunk: inference_pb2.GenerateChunk) -> bytes:
        """The last delta, content_block_stop, message_delta and message_stop (an error event if cancelled)."""
        head = b"" if self.opened else self._start
        self.opened = True
        if chunk.text:
            head += _DELTA_HEAD + orjson.dumps(chunk.text) + b"}}\n\n"
        reason = STOP_REASONS.get(chunk.finish_reason)
        if reason is None:
            return head + _event(b"error", ANTHROPIC_ERRORS.body(_cancelled(self.request_id)))
        return (
            head
            + _event(b"content_block_stop", b'{"type":"content_block_stop","index":0}')
            + _event(
                b"message_delta",
                orjson.dumps(
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": None},
                        "usage": usage(chunk.usage),
                    }
                ),
            )
            + self._id_line
            + str(chunk.seq).encode()
            + b"\n"
            + _event(b"message_stop", b'{"type":"message_stop"}')
        )


_DELTA_HEAD = (
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":'
)
