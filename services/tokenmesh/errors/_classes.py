"""A worker's failure classes: decided once, from the backend's error text, and what each means to the caller."""

from __future__ import annotations

import re

from tokenmesh.errors._taxonomy import (
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    MeshError,
    NotFound,
    Unavailable,
    label,
)
from tokenmesh.v1 import worker_pb2

ERROR_CLASS_TO_EXCEPTION: dict[worker_pb2.ErrorClass, type[MeshError]] = {
    worker_pb2.ERROR_CLASS_INVALID_REQUEST: InvalidArgument,
    worker_pb2.ERROR_CLASS_MODEL_NOT_FOUND: NotFound,
    worker_pb2.ERROR_CLASS_UNAVAILABLE: Unavailable,
    worker_pb2.ERROR_CLASS_TIMEOUT: DeadlineExceeded,
    worker_pb2.ERROR_CLASS_OUT_OF_MEMORY: Unavailable,
    worker_pb2.ERROR_CLASS_BACKEND: Internal,
    worker_pb2.ERROR_CLASS_DEVICE_LOST: Unavailable,
}

# Error classes that say nothing bad about the worker: the caller must act.
CALLER_ERROR_CLASSES = frozenset({worker_pb2.ERROR_CLASS_INVALID_REQUEST, worker_pb2.ERROR_CLASS_MODEL_NOT_FOUND})

# (pattern, class) in priority order, matched against backend error text. The
# texts are what Triton, its Python backend, vLLM and llama.cpp actually send.
_BACKEND_PATTERNS: tuple[tuple[re.Pattern[str], worker_pb2.ErrorClass], ...] = tuple(
    (re.compile(p, re.IGNORECASE), c)
    for p, c in (
        (
            r"out of memory|CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation|\bOOM\b",
            worker_pb2.ERROR_CLASS_OUT_OF_MEMORY,
        ),
        (
            r"illegal memory access|unspecified launch failure|CUDA_ERROR_LAUNCH_FAILED|cudaErrorLaunchFailure|"
            r"device-side assert|uncorrectable ECC|CUDA_ERROR_ECC_UNCORRECTABLE|\bXid\b|GPU is lost|"
            r"CUDA driver (error|version)|CUDA error: unknown error",
            worker_pb2.ERROR_CLASS_DEVICE_LOST,
        ),
        (
            r"exceeds the available context size|invalid request|invalid_request_error|"
            r"maximum context length|must be (greater|less|positive|a)|unexpected inference input",
            worker_pb2.ERROR_CLASS_INVALID_REQUEST,
        ),
        (r"unknown model|has no available versions", worker_pb2.ERROR_CLASS_MODEL_NOT_FOUND),
        (r"deadline exceeded|timed out|timeout", worker_pb2.ERROR_CLASS_TIMEOUT),
        (
            r"not ready|unavailable|connect|socket closed|stub process .* is not healthy",
            worker_pb2.ERROR_CLASS_UNAVAILABLE,
        ),
    )
)


def classify_backend_message(message: str) -> worker_pb2.ErrorClass:
    """Return the ``ErrorClass`` for a backend's error text (BACKEND when unknown)."""
    for pattern, error_class in _BACKEND_PATTERNS:
        if pattern.search(message):
            return error_class
    return worker_pb2.ERROR_CLASS_BACKEND


def from_generation_error(error: worker_pb2.GenerationError, worker: str = "") -> MeshError:
    """Turn a worker's typed error into the caller-facing exception (reason: its error class, e.g. OUT_OF_MEMORY)."""
    reason = label(error.error_class, worker_pb2.ErrorClass).upper()
    return ERROR_CLASS_TO_EXCEPTION.get(error.error_class, Internal)(
        error.message, reason=reason, metadata={"worker": worker} if worker else None
    )
