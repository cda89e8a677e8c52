"""``Inference/Resume`` on the router: find the worker holding a generation, replay it from after_seq, follow it.

A resumed stream is not moved to another worker when its worker fails: it is
reported (the caller resumes again, and the generation's own stream, if any,
fails over on its own).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from tokenmesh.errors import AlreadyExists, MeshError, NotFound, Unavailable, from_rpc_error
from tokenmesh.links import Links
from tokenmesh.router._generation import Caller
from tokenmesh.router._live import LiveTable
from tokenmesh.router._outcome import WorkerFailed, outcome
from tokenmesh.router._pool import WorkerPool
from tokenmesh.router._relay import chunk
from tokenmesh.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
from tokenmesh.validation import require_request_id

TEARDOWN_WAIT_S = 2.0
"""How long Resume waits for this router's old stream of the same request_id to be torn down."""


async def follow(
    request: inference_pb2.ResumeRequest, caller: Caller, live: LiveTable, pool: WorkerPool, links: Links
) -> AsyncIterator[inference_pb2.GenerateChunk]:
    """The chunks after request.after_seq of the generation a worker holds, replayed then live."""
    request_id = request.request_id
    require_request_id(request_id)
    held = live.by_id.get(request_id)
    if held is not None:
        # A caller that cancels its stream and resumes at once can overtake the
        # teardown of its old stream here: give that a moment to finish.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(held.ended.wait(), TEARDOWN_WAIT_S)
    if request_id in live.by_id:
        raise AlreadyExists(f"generation {request_id!r} is being streamed by this router already")
    live.refuse_if_draining()
    live.begin(request_id, resumed=True)  # so Generate and Cancel see it is being streamed here
    try:
        for entry in sorted(pool.entries.values(), key=lambda e: not e.healthy):
            call = (
                links[entry.address]
                .stub(worker_pb2_grpc.WorkerStub)
                .Attach(
                    worker_pb2.AttachRequest(request_id=request_id, after_seq=request.after_seq),
                    timeout=caller.time_remaining(),
                )
            )
            try:
                event = await call.read()
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.OUT_OF_RANGE:  # it holds it, but not from after_seq
                    raise from_rpc_error(exc) from exc
                continue  # not there (NOT_FOUND) or not reachable: ask the next worker
            try:
                while event is not grpc.aio.EOF and event.WhichOneof("event") != "error":
                    yield chunk(event, request_id, "")
                    if event.WhichOneof("event") == "end":
                        return
                    event = await call.read()
                ended = None if event is grpc.aio.EOF else event.error
                failure = outcome(ended, entry.address, received=True)
            except grpc.aio.AioRpcError as exc:
                failure = outcome(exc, entry.address, received=True)
            finally:
                call.cancel()
            raise _not_moved(failure, entry.address, request_id)
        raise NotFound(
            f"no worker holds generation {request_id!r}: unknown id, cancelled, or finished "
            "longer ago than the resume grace period"
        )
    finally:
        live.end(request_id)


def _not_moved(failure: WorkerFailed | MeshError, worker: str, request_id: str) -> MeshError:
    """A Resume's error for how its attempt ended: a worker failure is reported, not failed over."""
    if isinstance(failure, MeshError):
        return failure
    error = Unavailable(
        f"worker {worker} holding {request_id} failed during Resume ({failure}); "
        "a resumed stream is not moved to another worker"
    )
    error.__cause__ = failure
    return error
