"""What the calling side of a multiplexed call reads: one logical stream's events, and the credit it owes back.

Two calls carry many generations as logical streams, and on both the caller
reads each stream as if it were its own call: the router's attempts on a
``Worker/Link`` (:class:`tokenmesh.router._link.Attempt`, read like a
``Worker/Generate`` call) and the client's streams on
``Inference/GenerateStream`` (:class:`tokenmesh.client._stream.Stream`, read
like a ``Generate`` call). On both, the session's reader task puts each event
into the stream's mailbox and never waits for the consumer (the peer sends no
more than the stream's credit, which bounds the mailbox); the one consumer
takes them, and returns the credit it took in batches of a quarter of the
window, which the session's :class:`~tokenmesh.outbox.Outbox` coalesces into
the writer's next message. The writing side is :mod:`tokenmesh.outbox`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, Protocol, TypeVar

Event = TypeVar("Event")


class Grants(Protocol):
    """The session an inbox returns its credit through."""

    grant_at: int
    """Credit owed that is returned in one grant (a quarter of the window)."""

    def grant(self, stream: int, credit: int) -> None:
        """Return credit to a stream in the writer's next message."""


class Inbox(Generic[Event]):
    """One logical stream's mailbox: filled by the session's reader, read by one consumer.

    Args:
        grants: the session its credit goes back through.
        stream: its id on the call.

    """

    __slots__ = ("_ended", "_grants", "_mailbox", "_owed", "_waiter", "stream")

    stream: int
    _grants: Grants
    _mailbox: deque[Event | BaseException]
    _waiter: asyncio.Future[None] | None
    _owed: int
    """Credit taken by the consumer and not yet returned."""
    _ended: bool
    """The peer ended the stream (or the call broke): nothing more comes."""

    def __init__(self, grants: Grants, stream: int) -> None:
        self.stream = stream
        self._grants = grants
        self._mailbox = deque()
        self._waiter = None
        self._owed = 0
        self._ended = False

    def put(self, item: Event | BaseException, *, last: bool = False) -> None:
        """An event (or the error that ends the stream) for the consumer; wake it if it waits. Never awaits."""
        self._mailbox.append(item)
        if last:
            self._ended = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _take(self) -> Event | None:
        """The next event; raises the error that ended the stream; None when woken with nothing (let go)."""
        if not self._mailbox:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
            if not self._mailbox:
                return None
        item = self._mailbox.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def _owe(self, cost: int) -> None:
        """The consumer took cost bytes of credit: returned once a quarter window is owed, not per event."""
        self._owed += cost
        if self._owed >= self._grants.grant_at:
            self._grants.grant(self.stream, self._owed)
            self._owed = 0
