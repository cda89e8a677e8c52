"""How an attempt on a worker ended: the worker failed (run it elsewhere) or the caller erred (end the stream with it).

One rule for every place an attempt ends: a Generate attempt in
:meth:`~tokenmesh.router._relay.Relay.run`, and a Resume following a worker's
generation with Attach. Which of the two moves the stream on is the caller's
business (Generate fails over; Resume does not, it reports the failure).
"""

from __future__ import annotations

import grpc

from tokenmesh.errors import CALLER_ERROR_CLASSES, MeshError, from_generation_error, from_rpc_error, label
from tokenmesh.v1 import worker_pb2

CALLER_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)
"""A worker's statuses that are about the request, not the worker: the caller gets them as they are, and the
stream is not moved to another worker (any other status says the worker failed). RESOURCE_EXHAUSTED joins them
once the worker has sent an event: then it says the caller reads too slowly (see :func:`outcome`)."""


AT_LIMIT = "at_limit"
"""The kind of a start the worker refused because it runs as many generations as it accepts (WORKER_AT_LIMIT):
busy, not failed. Several routers each send a worker up to its whole limit; the one refused waits again for a
slot, ahead of its queue, and sends that worker less for a while (:meth:`~tokenmesh.router._pool.WorkerPool.refused`).
It is no failover: the worker is not avoided and the attempt does not count toward --max-migrations."""


class WorkerFailed(Exception):
    """The worker could not run the generation; another worker may.

    Args:
        message: what happened, for logs and the caller's error.
        kind: which failure, from a small fixed set (a metric label): ``closed``, ``seq_gap``, ``stall``, ``slow`` (one
            generation silent on a worker that sends others'), ``at_limit`` (:data:`AT_LIMIT`: refused, busy), a
            status code's name (``unavailable``...) or the worker's error class (``backend``, ``out_of_memory``...).

    """

    kind: str

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def error_kind(error_class: worker_pb2.ErrorClass) -> str:
    """A worker error class as a metric label: ERROR_CLASS_OUT_OF_MEMORY -> out_of_memory."""
    return label(error_class, worker_pb2.ErrorClass)


def outcome(
    ended: worker_pb2.GenerationError | grpc.aio.AioRpcError | None, worker: str, *, received: bool
) -> WorkerFailed | MeshError:
    """The error an attempt that ended without its end event raises: WorkerFailed, or the caller's own error.

    Args:
        ended: how it ended: the worker's error event, the call's status, or None for a stream closed without an end.
        worker: the worker's address (named in a caller's error).
        received: whether the worker had sent an event before.

    """
    if ended is None:
        return WorkerFailed("worker closed the stream without an end", "closed")
    if isinstance(ended, worker_pb2.GenerationError):
        if ended.error_class in CALLER_ERROR_CLASSES:
            return from_generation_error(ended, worker)
        return WorkerFailed(ended.message, error_kind(ended.error_class))
    code = ended.code()
    # Before the first event RESOURCE_EXHAUSTED is the worker at its limit (run it elsewhere);
    # after it, the caller reading too slowly (the worker's replay buffer overflowed).
    if code in CALLER_CODES or (code == grpc.StatusCode.RESOURCE_EXHAUSTED and received):
        return from_rpc_error(ended)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and from_rpc_error(ended).reason == "WORKER_AT_LIMIT":
        return WorkerFailed(f"{code.name}: {ended.details()}", AT_LIMIT)
    return WorkerFailed(f"{code.name}: {ended.details()}", label(code))
