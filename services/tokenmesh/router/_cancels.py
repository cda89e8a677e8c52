"""Telling workers to stop a generation: the one a stream left (in the background), or whichever holds it."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from tokenmesh.v1 import inference_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


class WorkerCancels:
    """Worker/Cancel calls on behalf of the router.

    Args:
        stubs: the router's worker stubs by address (shared; the router adds to it).

    """

    _stubs: dict[str, worker_pb2_grpc.WorkerStub]
    _background: set[asyncio.Task[None]]
    """Cancels in flight that nobody awaits (held so they are not collected mid-call)."""

    def __init__(self, stubs: dict[str, worker_pb2_grpc.WorkerStub]) -> None:
        self._stubs = stubs
        self._background = set()

    def abandon(self, address: str, request_id: str) -> None:
        """Tell a worker to stop a generation this router no longer streams, in the background.

        The deadline is long on purpose: a stalled (e.g. SIGSTOPped) worker
        gets the cancel when it runs again, and does not go on generating a
        stream that moved elsewhere.
        """
        stub = self._stubs.get(address)
        if stub is None:
            return

        async def cancel() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.Cancel(inference_pb2.CancelRequest(request_id=request_id), timeout=60)

        task = asyncio.create_task(cancel())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def everywhere(self, request_id: str) -> bool:
        """Ask every worker to stop request_id; whether one held it."""
        cancelled = False
        for address, stub in self._stubs.items():
            try:
                await stub.Cancel(inference_pb2.CancelRequest(request_id=request_id), timeout=5)
                cancelled = True
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    log.debug("Cancel of %s on %s: %s", request_id, address, exc.code().name)
        return cancelled
