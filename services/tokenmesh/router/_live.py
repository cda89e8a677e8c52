"""What this router streams now: its generations and resumes by request_id, and whether it drains."""

from __future__ import annotations

import asyncio

from tokenmesh.errors import AlreadyExists, Unavailable
from tokenmesh.router._transport import WorkerStream


class Live:
    """A generation (or a resume) this router is streaming now.

    Args:
        resumed: a Resume stream (it follows a worker's generation with Attach; a Cancel goes to the workers).

    """

    call: WorkerStream | None
    """The worker stream of the attempt in progress (None while none runs)."""
    cancelled: asyncio.Future[None]
    """Done once Inference/Cancel asked for it to stop (one waiting for a worker slot stops at once)."""
    ended: asyncio.Event
    """Set once the stream is torn down (a Resume of the same id waits for it)."""
    resumed: bool

    def __init__(self, *, resumed: bool = False) -> None:
        self.call = None
        self.cancelled = asyncio.get_running_loop().create_future()
        self.ended = asyncio.Event()
        self.resumed = resumed

    def cancel(self) -> None:
        """Inference/Cancel asks for the generation to stop."""
        if not self.cancelled.done():
            self.cancelled.set_result(None)


class LiveTable:
    """The generations and resumes this router streams now, by request_id; the streams of GenerateStream calls."""

    by_id: dict[str, Live]
    idle: asyncio.Event
    """Set while nothing is streamed by this router, nor any stream of a GenerateStream call open (the drain waits
    for it)."""
    draining: bool
    """Set when the router drains: new generations and resumes get UNAVAILABLE."""
    open_streams: int
    """Streams open on GenerateStream calls (from their start until their end is taken to be sent)."""

    def __init__(self) -> None:
        self.by_id = {}
        self.idle = asyncio.Event()
        self.idle.set()
        self.draining = False
        self.open_streams = 0

    def begin(self, request_id: str, *, resumed: bool = False) -> Live:
        """Count a stream of request_id as live on this router."""
        live = self.by_id[request_id] = Live(resumed=resumed)
        self.idle.clear()
        return live

    def end(self, request_id: str) -> None:
        """The stream of request_id is torn down."""
        self.by_id.pop(request_id).ended.set()
        self._settle()

    def opened(self, change: int) -> None:
        """A GenerateStream stream opened (+1) or is over on its call (-1)."""
        self.open_streams += change
        if self.open_streams:
            self.idle.clear()
        else:
            self._settle()

    def _settle(self) -> None:
        if not self.by_id and not self.open_streams:
            self.idle.set()

    def refuse_if_live(self, request_id: str) -> None:
        """REQUEST_ID_LIVE for an id this router streams now."""
        if request_id in self.by_id:
            raise AlreadyExists(
                f"request_id {request_id!r} is live already; use a new id, or Resume it",
                reason="REQUEST_ID_LIVE",
                field="request_id",
            )

    def refuse_if_draining(self) -> None:
        """ROUTER_DRAINING once the router drains."""
        if self.draining:
            raise Unavailable(
                "this router is draining (shutting down); send the call to another router", reason="ROUTER_DRAINING"
            )
