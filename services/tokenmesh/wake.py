"""How the send loop of a multiplexed call's sending side sleeps: until kicked, or for at most a linger.

The worker's side of ``Worker/Link`` and the router's side of
``Inference/GenerateStream`` each run one send loop that takes everything
ready into one message. Between messages it waits on one future (no timer)
until a stream becomes ready; when a send would hold fewer streams than the
call carries, it may linger: the same future, and one timer as the bound.
Which sends linger, and what ends a linger early, is each side's own rule.
"""

from __future__ import annotations

import asyncio


class Wake:
    """One send loop's wait: ``idle`` until ``kick``, or ``linger`` until ``kick`` or the bound."""

    lingering: bool
    """A linger is in progress (a stream that becomes ready kicks only if the side's rule says so)."""
    _future: asyncio.Future[None] | None

    def __init__(self) -> None:
        self.lingering = False
        self._future = None

    async def idle(self) -> None:
        """Wait until kicked (a future, no timer)."""
        self._future = asyncio.get_running_loop().create_future()
        try:
            await self._future
        finally:
            self._future = None

    async def linger(self, seconds: float) -> None:
        """Wait until kicked, or seconds have passed (one timer, not a sleep per stream)."""
        loop = asyncio.get_running_loop()
        self._future = loop.create_future()
        self.lingering = True
        timer = loop.call_later(seconds, self.kick)
        try:
            await self._future
        finally:
            timer.cancel()
            self.lingering = False
            self._future = None

    def kick(self) -> None:
        """End the wait in progress, if any."""
        if self._future is not None and not self._future.done():
            self._future.set_result(None)
