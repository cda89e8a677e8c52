"""Checks of what a caller sends, before anything is admitted: each failure says what to change."""

from __future__ import annotations

from tokenmesh.router._pool import WorkerPool
from tokenmesh.v1 import inference_pb2
from tokenmesh.validation import check_max_tokens, check_request


def validate(
    request: inference_pb2.GenerateRequest, pool: WorkerPool, max_prompt_bytes: int
) -> inference_pb2.ModelInfo:
    """The model request runs on; InvalidArgument (or the pool's NotFound/Unavailable) when it cannot run."""
    check_request(request, max_prompt_bytes)
    model = pool.resolve_model(request.model)
    check_max_tokens(request, model.name, model.max_context)
    return model
