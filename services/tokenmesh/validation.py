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


def check_request(request: inference_pb2.GenerateRequest, max_prompt_bytes: int | None = None) -> None:
    """Raise InvalidArgument when the request's own fields cannot make a generation."""
    if bool(request.prompt) == bool(request.messages):
        if request.prompt:
            raise InvalidArgument("set either prompt or messages, not both")
        raise InvalidArgument("empty request: set prompt, or messages with at least one {role, content}")
    if max_prompt_bytes is not None:
        size = len(request.prompt.encode()) + sum(len(m.content.encode()) for m in request.messages)
        if size > max_prompt_bytes:
            raise InvalidArgument(f"prompt is {size} bytes; the limit is {max_prompt_bytes} bytes: shorten it")
    for i, message in enumerate(request.messages):
        if message.role not in ROLES:
            raise InvalidArgument(f"messages[{i}].role is {message.role!r}; use one of {', '.join(sorted(ROLES))}")
    if request.HasField("temperature") and not (request.temperature >= 0 and math.isfinite(request.temperature)):
        raise InvalidArgument(f"temperature must be >= 0, got {request.temperature}")
    if request.HasField("top_p") and not (0 < request.top_p <= 1):
        raise InvalidArgument(f"top_p must be in (0, 1], got {request.top_p}")
    if request.priority not in inference_pb2.Priority.values():
        raise InvalidArgument(f"unknown priority {request.priority}; use PRIORITY_LOW, _NORMAL or _HIGH")


def check_max_tokens(request: inference_pb2.GenerateRequest, model: str, max_context: int) -> None:
    """Raise InvalidArgument unless max_tokens (when set) fits the model's context."""
    if request.HasField("max_tokens") and not (1 <= request.max_tokens <= max_context):
        raise InvalidArgument(
            f"max_tokens must be 1..{max_context} (the context size of {model!r}), got {request.max_tokens}"
        )


def require_request_id(request_id: str) -> None:
    """Raise InvalidArgument for an empty request_id (Resume, Cancel, Attach)."""
    if not request_id:
        raise InvalidArgument("request_id is required: the one the generation was started with")
