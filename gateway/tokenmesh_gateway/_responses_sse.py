"""The Responses API's wire format: the Response object and its streamed events, numbered from the mesh's seq.

A stream is ``response.created`` (0), ``response.in_progress`` (1),
``response.output_item.added`` (2), ``response.content_part.added`` (3), a
``response.output_text.delta`` per chunk of the mesh — the chunk with seq
``k`` is event ``3 + k`` — then ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done`` and the end:
``response.completed`` (the model stopped), ``response.incomplete`` (at
``max_output_tokens``; also a cancelled response, whose status says
``cancelled``) or ``response.failed`` (an error after the first chunk: the
Response with its error and its text so far, numbered after the last event
sent). The final chunk's delta is event
``3 + L`` when it has text (the closing events follow from ``4 + L``), else
the closing events start at ``3 + L``. Every ``sequence_number`` is thus a
function of the generation alone, whichever gateway writes it and after any
restart: ``starting_after=N`` means the same events everywhere, and the
numbers of one stream are contiguous from 0.

The mesh's chunks are the same for every reader (a worker merges only
chunks nobody has read, and a seq keeps its text once read), so the deltas
are too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from tokenmesh.v1 import inference_pb2
from tokenmesh_gateway._errors import OPENAI_ERRORS, ErrorShape, HttpError
from tokenmesh_gateway._responses import Echo

OPENING = 4
"""Events before the first delta: created, in_progress, output_item.added, content_part.added (0..3)."""

STATUS: dict[int, str] = {
    inference_pb2.FINISH_REASON_STOP: "completed",
    inference_pb2.FINISH_REASON_LENGTH: "incomplete",
    inference_pb2.FINISH_REASON_CANCELLED: "cancelled",
    inference_pb2.FINISH_REASON_ERROR: "failed",
}
"""A finished response's status, by the final chunk's finish_reason."""

_TERMINAL = {
    "completed": b"response.completed",
    "incomplete": b"response.incomplete",
    "cancelled": b"response.incomplete",  # OpenAI's streams have no cancelled event; the response says cancelled
    "failed": b"response.failed",
}


def response_id(request_id: str) -> str:
    """The Response's ``id``: ``resp_<request_id>``."""
    return "resp_" + request_id


def message_id(request_id: str) -> str:
    """The output message's ``id``: ``msg_<request_id>`` (the same on every gateway)."""
    return "msg_" + request_id


@dataclass(frozen=True, slots=True)
class Head:
    """What a Response says besides its output: its id, times, model and the request's echo."""

    request_id: str
    """The generation's id as the caller knows it (its Response is ``resp_<request_id>``)."""
    created_at: int
    model: str
    echo: Echo = field(default_factory=Echo)


@dataclass(frozen=True, slots=True)
class Outcome:
    """How far a response got: its status, text so far, and what its end says."""

    status: str
    text: str
    final: inference_pb2.GenerateChunk | None = None
    error: HttpError | None = None
    completed_at: int | None = None
    """When it finished (Unix seconds); None while it runs."""


def response_object(head: Head, outcome: Outcome) -> dict[str, Any]:
    """The Response object (``"object": "response"``) for head at outcome."""
    final = outcome.final
    status = outcome.status
    done = status in ("completed", "incomplete", "cancelled", "failed")
    output = []
    if outcome.text or done:
        item_status = "completed" if status == "completed" else "incomplete" if done else "in_progress"
        output.append(_message(head.request_id, outcome.text, item_status))
    usage = None
    if final is not None:
        prompt, completion = final.usage.prompt_tokens, final.usage.completion_tokens
        usage = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": final.usage.cached_prompt_tokens},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        }
    error = None
    if outcome.error is not None:
        error = {"code": "server_error", "message": outcome.error.message}
    echo = head.echo
    return {
        "id": response_id(head.request_id),
        "object": "response",
        "created_at": head.created_at,
        "completed_at": outcome.completed_at,
        "status": outcome.status,
        "background": echo.background,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if outcome.status == "incomplete" else None,
        "instructions": echo.instructions,
        "max_output_tokens": echo.max_output_tokens,
        "metadata": echo.metadata,
        "model": (final.model if final is not None and final.model else "") or head.model,
        "output": output,
        "parallel_tool_calls": False,
        "previous_response_id": None,
        "store": echo.store,
        "temperature": echo.temperature,
        "text": {"format": echo.text_format},
        "tool_choice": "none",
        "tools": [],
        "top_p": echo.top_p,
        "truncation": "disabled",
        "usage": usage,
    }


def _message(request_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": message_id(request_id),
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _event(name: bytes, number: int, data: dict[str, Any]) -> bytes:
    data["sequence_number"] = number
    return b"event: " + name + b"\ndata: " + orjson.dumps({"type": name.decode(), **data}) + b"\n\n"


@dataclass(slots=True)
class ResponsesAnswer:
    """How to answer one Responses request (``_stream.Answer``): the Response object, or its events after ``after``.

    Mutable: the answer keeps its stream's encoder, so an error event after the first chunk is numbered right
    after the last event sent.
    """

    stream: bool
    head: Head
    after: int = -1
    """Send only the events with a sequence_number above this (``starting_after``); -1: all of them."""
    id_prefix: str = ""
    """What the mesh's request ids carry in front of the caller's (its tenant); the caller never sees it."""
    errors: ErrorShape = OPENAI_ERRORS
    opening_status: str = "in_progress"
    """The status ``response.created`` carries (a background response's is ``queued``)."""
    encoding: ResponsesEncoder | None = None

    def encoder(self, request_id: str, model: str) -> ResponsesEncoder:
        """The events of the stream (the Response's request id is the head's)."""
        head = replace(self.head, request_id=request_id, model=model or self.head.model)
        self.encoding = ResponsesEncoder(head, self.after, self.opening_status)
        return self.encoding

    def whole(self, request_id: str, text: str, last: inference_pb2.GenerateChunk) -> bytes:
        """The Response object of a finished generation."""
        head = replace(self.head, request_id=request_id)
        outcome = Outcome(STATUS[last.finish_reason], text, last, completed_at=int(time.time()))
        return orjson.dumps(response_object(head, outcome))

    def error_event(self, error: HttpError) -> bytes:
        """``response.failed``, numbered after the last event sent: the end of the stream.

        It carries the Response with its error and its output so far; before any event, OpenAI's bare ``error``.
        """
        if self.encoding is None:
            return _event(b"error", 0, {"code": error.code, "message": error.message, "param": error.param})
        return self.encoding.failed(error)


class ResponsesEncoder:
    """The events of one Response stream, each with its sequence_number; those up to ``after`` are left out.

    Args:
        head: the Response's id, times, model and echo.
        after: ``starting_after``: only events numbered above it are written (-1: every one).
        opening_status: the status of the Response in ``response.created``.

    """

    head: Head
    after: int
    texts: list[str]
    """Every delta's text so far (the done events and the final Response carry the whole text)."""
    next_number: int
    """The sequence_number of the next event."""
    _opening: bytes
    _delta_head: bytes

    def __init__(self, head: Head, after: int = -1, opening_status: str = "in_progress") -> None:
        self.head = head
        self.after = after
        self.texts = []
        self.next_number = 0
        item_id = orjson.dumps(message_id(head.request_id))
        self._delta_head = (
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","item_id":'
            + item_id
            + b',"output_index":0,"content_index":0,"delta":'
        )
        started = response_object(head, Outcome(opening_status, ""))
        running = response_object(head, Outcome("in_progress", ""))
        item = {
            "id": message_id(head.request_id),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events = (
            _event(b"response.created", 0, {"response": started}),
            _event(b"response.in_progress", 1, {"response": running}),
            _event(b"response.output_item.added", 2, {"output_index": 0, "item": item}),
            _event(
                b"response.content_part.added",
                3,
                {"item_id": message_id(head.request_id), "output_index": 0, "content_index": 0, "part": part},
            ),
        )
        self._opening = b"".join(event for number, event in enumerate(events) if number > after)

    def chunk(self, chunk: inference_pb2.GenerateChunk) -> bytes:
        """The chunk's delta (after the opening events, on the first chunk)."""
        self.texts.append(chunk.text)
        number = OPENING - 1 + chunk.seq
        head = self._opening
        if head:
            self._opening = b""
        self.next_number = number + 1
        if number <= self.after:
            return head
        # The hot path: only the text is JSON-encoded, the rest is bytes made once per stream.
        return (
            head
            + self._delta_head
            + orjson.dumps(chunk.text)
            + b',"logprobs":[],"sequence_number":'
            + str(number).encode()
            + b"}\n\n"
        )

    def failed(self, error: HttpError) -> bytes:
        """``response.failed`` after the events sent so far: the Response, its error and its text so far."""
        response = response_object(self.head, Outcome("failed", "".join(self.texts), error=error))
        out = self._opening + _event(b"response.failed", self.next_number, {"response": response})
        self._opening = b""
        self.next_number += 1
        return out

    def last(self, chunk: inference_pb2.GenerateChunk) -> bytes:
        """The final chunk's delta (if it has text), the done events and the end: the rest of the stream."""
        out = self._opening
        self._opening = b""
        number = OPENING - 1 + chunk.seq
        if chunk.text:
            self.texts.append(chunk.text)
            if number > self.after:
                out += (
                    self._delta_head
                    + orjson.dumps(chunk.text)
                    + b',"logprobs":[],"sequence_number":'
                    + str(number).encode()
                    + b"}\n\n"
                )
            number += 1
        text = "".join(self.texts)
        status = STATUS.get(chunk.finish_reason, "failed")
        item_id = message_id(self.head.request_id)
        where = {"item_id": item_id, "output_index": 0, "content_index": 0}
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        response = response_object(self.head, Outcome(status, text, chunk, completed_at=int(time.time())))
        events = (
            (b"response.output_text.done", {**where, "text": text, "logprobs": []}),
            (b"response.content_part.done", {**where, "part": part}),
            (b"response.output_item.done", {"output_index": 0, "item": response["output"][0]}),
            (_TERMINAL[status], {"response": response}),
        )
        for name, data in events:
            if number > self.after:
                out += _event(name, number, data)
            number += 1
        self.next_number = number
        return out
