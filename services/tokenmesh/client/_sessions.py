"""A client's GenerateStream calls, one per router, opened on first use; the routers that predate the call.

:class:`Sessions` is the client's road to its routers, as the router's
:mod:`tokenmesh.router._transport` is to its workers: a router that answered
UNIMPLEMENTED predates ``GenerateStream`` and gets ``Generate``/``Resume``
until its channel is renewed or the client closed.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging

import grpc

from tokenmesh.client._stream import OpenCall, StreamSession, broken
from tokenmesh.mux import read_settings

log = logging.getLogger(__name__)


class Sessions:
    """A client's GenerateStream sessions by router address, opened on first use; routers that predate the call.

    Args:
        open_call: opens a GenerateStream call to an address (on the client's link to it).

    """

    _open_call: OpenCall
    _sessions: dict[str, StreamSession]
    _opening: dict[str, asyncio.Task[StreamSession | None]]
    _retired: set[StreamSession]
    """Sessions of replaced channels, serving the streams on them until those end."""
    unbatched: set[str]
    """Routers that answered UNIMPLEMENTED: Generate and Resume for them, until renew() or close()."""

    def __init__(self, open_call: OpenCall) -> None:
        self._open_call = open_call
        self._sessions = {}
        self._opening = {}
        self._retired = set()
        self.unbatched = set()

    async def get(self, address: str) -> StreamSession | None:
        """The router's open session, opened now if there is none; None for a router that predates the call.

        Raises the ``grpc.aio.AioRpcError`` the opening failed with (the router down: UNAVAILABLE), as a
        Generate call to it would.
        """
        if address in self.unbatched:
            return None
        session = self._sessions.get(address)
        if session is not None and session.open:
            return session
        opening = self._opening.get(address)
        if opening is None:
            # In a context of its own: the call outlives the generation that opened it, so its RPC span (tracing on)
            # is no generation's child; each stream carries its own traceparent in its start's metadata.
            opening = self._opening[address] = asyncio.create_task(self._open(address), context=contextvars.Context())
            opening.add_done_callback(lambda done: self._opened(address, done))
        try:
            return await asyncio.shield(opening)  # one opening for every generation waiting on it
        except grpc.aio.AioRpcError as exc:  # an error each: raised in many tasks, one would share its traceback
            raise grpc.aio.AioRpcError(
                exc.code(), exc.initial_metadata(), exc.trailing_metadata(), exc.details()
            ) from None

    def _opened(self, address: str, opening: asyncio.Task[StreamSession | None]) -> None:
        if self._opening.get(address) is opening:
            del self._opening[address]
        if not opening.cancelled():
            opening.exception()  # taken: its waiters (if any are left) have their own copies

    async def _open(self, address: str) -> StreamSession | None:
        call = self._open_call(address)
        try:
            settings = await read_settings(call, f"router {address}")
        except TimeoutError:
            raise broken(grpc.StatusCode.UNAVAILABLE, f"router {address} sent no StreamSettings") from None
        except ConnectionError as exc:
            raise broken(grpc.StatusCode.UNAVAILABLE, f"{exc} (GenerateStream)") from None
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            log.info("router %s does not serve Inference/GenerateStream: one Generate call per generation", address)
            self.unbatched.add(address)
            return None
        session = self._sessions[address] = StreamSession(address, call, settings)
        session.serve_task().add_done_callback(lambda _: self._ended(session))
        return session

    def _ended(self, session: StreamSession) -> None:
        if self._sessions.get(session.address) is session:
            del self._sessions[session.address]
        self._retired.discard(session)

    def renew(self) -> None:
        """New channels: new streams open new calls on them; streams on the old calls run to their end there."""
        self.unbatched.clear()  # asked again on the new channel (an upgrade restarts the router)
        for session in self._sessions.values():
            self._retired.add(session)
            session.retire()
        self._sessions.clear()

    async def close(self) -> None:
        """End every call (their streams break) and forget what the routers speak."""
        for opening in list(self._opening.values()):
            opening.cancel()
        sessions = [*self._sessions.values(), *self._retired]
        self._sessions.clear()
        self._retired.clear()
        self.unbatched.clear()
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)
