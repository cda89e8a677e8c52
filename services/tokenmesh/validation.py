"""Checks of a ``GenerateRequest`` that hold wherever it arrives: the router, and a worker called directly.

Each failure is an :class:`~tokenmesh.errors.InvalidArgument` that says what
to change. What depends on the model (``max_tokens`` against its context) is
checked by the caller once it knows the model.
"""

from __future__ import annotations

import math

from tokenmesh.errors import InvalidArgument
from tokenmesh.v1 import inference_pb2

ROLES = frozenset({"system", "user", "assistant"})
"""Roles a chat message may have."""
MAX_LABELS = 16
"""Labels a request may carry (each one is held for the whole generation, by router and worker)."""
MAX_LABEL_KEY_CHARS = 64
MAX_LABEL_VALUE_CHARS = 256
MAX_STOP = 16
"""Stop sequences a request may have (OpenAI allows 4; each is matched against every token)."""
MAX_STOP_CHARS = 512
MAX_REQUEST_ID_CHARS = 128


def check_request(request: inference_pb2.GenerateRequest, max_prompt_bytes: int | None = None) -> None:
    """Raise InvalidArgument when the request's own fields cannot make a generation."""
    if bool(request.prompt) == bool(request.messages):
        if request.prompt:
            raise InvalidArgument("set either prompt or messages, not both", field="prompt")
        raise InvalidArgument(
            "empty request: set prompt, or messages with at least one {role, content}", field="prompt"
        )
    if max_prompt_bytes is not None:
        size = len(request.prompt.encode()) + sum(len(m.content.encode()) for m in request.messages)
        if size > max_prompt_bytes:
            raise InvalidArgument(
                f"prompt is {size} bytes; the limit is {max_prompt_bytes} bytes: shorten it", field="prompt"
            )
    for i, message in enumerate(request.messages):
        if message.role not in ROLES:
            raise InvalidArgument(
                f"messages[{i}].role is {message.role!r}; use one of {', '.join(sorted(ROLES))}",
                field=f"messages[{i}].role",
            )
    if request.HasField("temperature") and not (request.temperature >= 0 and math.isfinite(request.temperature)):
        raise InvalidArgument(f"temperature must be >= 0, got {request.temperature}", field="temperature")
    if request.HasField("top_p") and not (0 < request.top_p <= 1):
        raise InvalidArgument(f"top_p must be in (0, 1], got {request.top_p}", field="top_p")
    if request.priority not in inference_pb2.Priority.values():
        raise InvalidArgument(
            f"unknown priority {request.priority}; use PRIORITY_LOW, _NORMAL or _HIGH", field="priority"
        )
    check_bounds(request)


def check_bounds(request: inference_pb2.GenerateRequest) -> None:
    """Raise InvalidArgument for fields past the limits that bound what one caller can make the mesh hold."""
    if len(request.request_id) > MAX_REQUEST_ID_CHARS or not request.request_id.isprintable():
        raise InvalidArgument(
            f"request_id must be at most {MAX_REQUEST_ID_CHARS} printable characters", field="request_id"
        )
    if len(request.labels) > MAX_LABELS:
        raise InvalidArgument(f"{len(request.labels)} labels; at most {MAX_LABELS}", field="labels")
    for key, value in request.labels.items():
        if not key or len(key) > MAX_LABEL_KEY_CHARS or not key.isprintable():
            raise InvalidArgument(
                f"label key {key[:MAX_LABEL_KEY_CHARS]!r}: 1..{MAX_LABEL_KEY_CHARS} printable characters",
                field="labels",
            )
        if len(value) > MAX_LABEL_VALUE_CHARS or not value.isprintable():
            raise InvalidArgument(
                f"label {key!r}: its value must be at most {MAX_LABEL_VALUE_CHARS} printable characters",
                field=f"labels[{key!r}]",
            )
    if len(request.stop) > MAX_STOP:
        raise InvalidArgument(f"{len(request.stop)} stop sequences; at most {MAX_STOP}", field="stop")
    for i, stop in enumerate(request.stop):
        if not stop or len(stop) > MAX_STOP_CHARS:
            raise InvalidArgument(f"stop[{i}] must be 1..{MAX_STOP_CHARS} characters", field=f"stop[{i}]")


def check_max_tokens(request: inference_pb2.GenerateRequest, model: str, max_context: int) -> None:
    """Raise InvalidArgument unless max_tokens (when set) fits the model's context."""
    if request.HasField("max_tokens") and not (1 <= request.max_tokens <= max_context):
        raise InvalidArgument(
            f"max_tokens must be 1..{max_context} (the context size of {model!r}), got {request.max_tokens}",
            field="max_tokens",
            metadata={"model": model, "max_context": str(max_context)},
        )


def require_request_id(request_id: str) -> None:
    """Raise InvalidArgument for an empty request_id (Resume, Cancel, Attach)."""
    if not request_id:
        raise InvalidArgument("request_id is required: the one the generation was started with", field="request_id")
