"""Worker/Generate calls opened ahead of need, one per worker, held by the worker's link.

Opening a bidi call (HTTP/2 stream, initial metadata, the worker's handler)
took about 0.5 ms of the first token's path; a spare has done that while the
previous generation ran. A spare carries no deadline: the caller's goes in
the start command (``timeout_s``). The link cancels its spare when the worker
is dropped or its channel replaced (the next spare opens on the new one).

A traced generation takes no spare and leaves none: its call is opened when it
goes to the worker, with its span's ``traceparent`` in the metadata, so the
call's RPC spans (router client, worker server) and the worker's generation
span are in its trace, children of its span. A spare's would be in the trace
of whichever generation was running when it was opened. Tracing costs that
half millisecond of the first token.
"""

from __future__ import annotations

from typing import Any

from tokenmesh.links import Links
from tokenmesh.v1 import worker_pb2_grpc

SPARE = "spare Generate"
"""The name a worker's link holds its spare under."""


class Spares:
    """One open Generate call per worker, taken by the next generation that goes there.

    Args:
        links: the router's links to its workers.

    """

    _links: Links

    def __init__(self, links: Links) -> None:
        self._links = links

    def take(self, address: str, trace_context: dict[str, str] | None = None) -> Any:  # a StreamStreamCall
        """A Generate call to the worker: its spare if that is still open, else a new one (traced: always new)."""
        link = self._links[address]
        if trace_context:
            return link.stub(worker_pb2_grpc.WorkerStub).Generate(metadata=tuple(trace_context.items()))
        spare = link.take(SPARE)
        if spare is not None and not spare.done():
            return spare
        return link.stub(worker_pb2_grpc.WorkerStub).Generate()

    def open(self, address: str) -> None:
        """Open the worker's spare for its next generation (unless one is open, or the worker was dropped)."""
        link = self._links.get(address)
        if link is not None and link.held(SPARE) is None:
            link.hold(SPARE, link.stub(worker_pb2_grpc.WorkerStub).Generate())
