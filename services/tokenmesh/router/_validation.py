"""Checks of what a caller sends, before anything is admitted: each failure says what to change."""

from __future__ import annotations

import math

from tokenmesh.errors import InvalidArgument
from tokenmesh.router._pool import WorkerPool
from tokenmesh.v1 import inference_pb2

ROLES = frozenset({"system", "user", "assistant"})
"""Roles a chat message may have."""


def validate(
    request: inference_pb2.GenerateRequest, pool: WorkerPool, max_prompt_bytes: int
) -> inference_pb2.ModelInfo:
    """The model request runs on; InvalidArgument (or the pool's NotFound/Unavailable) when it cannot run."""
    if bool(request.prompt) == bool(request.messages):
        if request.prompt:
            raise InvalidArgument("set either prompt or messages, not both")
        raise InvalidArgument("empty request: set prompt, or messages with at least one {role, content}")
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
    model = pool.resolve_model(request.model)
    if request.HasField("max_tokens") and not (1 <= request.max_tokens <= model.max_context):
        raise InvalidArgument(
            f"max_tokens must be 1..{model.max_context} (the context size of {model.name!r}), got {request.max_tokens}"
        )
    return model
