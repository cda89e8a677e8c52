"""The per-generation road to a worker: Worker/Generate calls, opened ahead of need, one per worker.

A worker that predates ``Worker/Link`` (and every worker with
``--worker-link off``) gets one ``Worker/Generate`` call per attempt, as a
:class:`GenerateCall`. It stays as the fallback of a rolling upgrade.

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

from collections.abc import Callable
from typing import Any

from tokenmesh.links import Links
from tokenmesh.retry import write
from tokenmesh.v1 import worker_pb2, worker_pb2_grpc

SPARE = "spare Generate"
"""The name a worker's link holds its spare under."""


class GenerateCall:
    """One attempt's Worker/Generate call, read as any of the router's worker streams.

    Args:
        call: the call (a spare, or one opened for a traced generation).
        refill: opens the worker's next spare once this one's start is sent (None: a traced call leaves the
            spares as they are).

    """

    __slots__ = ("_call", "_refill", "cancel", "read")

    stops_on_close = False
    """Closing the call may not reach the worker first: a generation left behind is cancelled by request_id."""
    _call: Any
    _refill: Callable[[], None] | None

    def __init__(self, call: Any, refill: Callable[[], None] | None) -> None:
        self._call = call
        self._refill = refill
        self.read = call.read  # the hot path: one read per token, no layer of ours
        self.cancel = call.cancel

    async def write(self, command: worker_pb2.WorkerCommand) -> None:
        """Send the start (then open the next spare) or a cancel; a call the worker ended raises its status."""
        await write(self._call, command)
        if self._refill is not None:
            self._refill()
            self._refill = None


class Spares:
    """One open Generate call per worker, taken by the next generation that goes there.

    Args:
        links: the router's links to its workers.

    """

    _links: Links

    def __init__(self, links: Links) -> None:
        self._links = links

    def take(self, address: str, trace_context: dict[str, str] | None = None) -> GenerateCall:
        """A Generate call to the worker: its spare if that is still open, else a new one (traced: always new)."""
        link = self._links[address]
        if trace_context:
            traced = link.stub(worker_pb2_grpc.WorkerStub).Generate(metadata=tuple(trace_context.items()))
            return GenerateCall(traced, None)
        spare = link.take(SPARE)
        if spare is None or spare.done():
            spare = link.stub(worker_pb2_grpc.WorkerStub).Generate()
        return GenerateCall(spare, lambda: self.open(address))

    def open(self, address: str) -> None:
        """Open the worker's spare for its next generation (unless one is open, or the worker was dropped)."""
        link = self._links.get(address)
        if link is not None and link.held(SPARE) is None:
            link.hold(SPARE, link.stub(worker_pb2_grpc.WorkerStub).Generate())
