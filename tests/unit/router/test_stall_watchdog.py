"""The stall watchdog: a silent worker is stalled; a busy one (sending other generations' events) is not, until
the slow limit; the router's own loop lag is never read as a stall."""

from __future__ import annotations

import asyncio
import time

from tokenmesh.router._pool import WorkerEntry
from tokenmesh.router._relay import LOOP_LAG_S, StallWatchdog


class Call:
    """The worker call the watchdog cancels."""

    cancelled_at: float | None = None

    def cancel(self) -> bool:
        self.cancelled_at = asyncio.get_running_loop().time()
        return True


def started(
    first_s: float = 5.0, between_s: float = 0.2, slow_s: float = 1.0
) -> tuple[Call, WorkerEntry, StallWatchdog]:
    """A watchdog past its first event, waiting for the next."""
    call, entry = Call(), WorkerEntry("w:1")
    watchdog = StallWatchdog(call, entry, first_s, between_s, slow_s)  # type: ignore[arg-type]
    watchdog.fed()
    watchdog.reading()
    return call, entry, watchdog


async def keep_hearing(entry: WorkerEntry, every_s: float, until_s: float) -> None:
    """Other generations on the same worker keep reading events."""
    loop = asyncio.get_running_loop()
    end = loop.time() + until_s
    while loop.time() < end:
        entry.heard_at = loop.time()
        await asyncio.sleep(every_s)


async def test_a_silent_worker_is_stalled_after_the_stall_limit() -> None:
    call, _, watchdog = started()
    begun = asyncio.get_running_loop().time()
    await asyncio.sleep(0.6)
    assert call.cancelled_at is not None
    assert 0.2 <= call.cancelled_at - begun < 0.45
    assert watchdog.stalled == "stalled: no output for 0.2 s"
    assert watchdog.kind == "stall"


async def test_a_generation_on_a_worker_that_sends_others_is_slow_not_stalled() -> None:
    call, entry, watchdog = started()
    begun = asyncio.get_running_loop().time()
    hearing = asyncio.create_task(keep_hearing(entry, 0.05, 0.7))
    await asyncio.sleep(0.6)
    assert call.cancelled_at is None  # three stall limits of its own silence, the worker busy
    await hearing
    await asyncio.sleep(0.6)
    assert call.cancelled_at is not None
    # The slow limit (1 s of its own silence) ends it while the worker is still heard from, or the worker's own
    # silence (0.2 s after the others stopped at 0.7 s) does: both before 1.2 s.
    assert 0.85 <= call.cancelled_at - begun < 1.2
    watchdog.stop()


async def test_the_slow_limit_bounds_a_stuck_generation_on_a_busy_worker() -> None:
    call, entry, watchdog = started(slow_s=0.5)
    begun = asyncio.get_running_loop().time()
    hearing = asyncio.create_task(keep_hearing(entry, 0.05, 1.5))
    await asyncio.sleep(1.0)
    assert call.cancelled_at is not None
    assert 0.5 <= call.cancelled_at - begun < 0.75
    assert "while the worker sent other generations' tokens" in watchdog.stalled
    assert watchdog.kind == "slow"  # the worker is not suspended for it
    hearing.cancel()


async def test_the_first_event_waits_for_the_first_token_limit_whatever_the_worker_sends() -> None:
    call, entry = Call(), WorkerEntry("w:1")
    watchdog = StallWatchdog(call, entry, 0.3, 0.1, 5.0)  # type: ignore[arg-type]
    hearing = asyncio.create_task(keep_hearing(entry, 0.02, 1.0))
    await asyncio.sleep(0.5)
    assert call.cancelled_at is not None  # others' tokens do not excuse a missing first token
    assert watchdog.stalled == "stalled: no output for 0.3 s"
    hearing.cancel()


async def test_the_routers_own_loop_lag_is_not_a_stall() -> None:
    call, _, watchdog = started(between_s=0.1)
    loop = asyncio.get_running_loop()

    def feed() -> None:
        watchdog.fed()
        watchdog.reading()

    def busy() -> None:  # the router's loop blocked past the stall limit; the waiting read lands two hops after it
        time.sleep(LOOP_LAG_S + 0.3)
        loop.call_soon(loop.call_soon, feed)

    loop.call_soon(busy)
    await asyncio.sleep(LOOP_LAG_S + 0.35)
    assert call.cancelled_at is None  # the late timer looked again after the read, instead of judging
    await asyncio.sleep(0.3)
    assert call.cancelled_at is not None  # then silence counts again
    watchdog.stop()
