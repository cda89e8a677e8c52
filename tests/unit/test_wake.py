"""A send loop's wait: idle until kicked, linger until kicked or its bound."""

from __future__ import annotations

import asyncio
import time

from tokenmesh.mux import Wake


async def test_idle_waits_for_a_kick_and_a_kick_with_nobody_waiting_is_lost() -> None:
    wake = Wake()
    wake.kick()  # nobody waits: nothing to end
    waiting = asyncio.ensure_future(wake.idle())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    wake.kick()
    await asyncio.wait_for(waiting, 1)


async def test_a_linger_ends_at_its_bound_or_at_a_kick_and_says_it_lingers_meanwhile() -> None:
    wake = Wake()
    started = time.monotonic()
    lingering = asyncio.ensure_future(wake.linger(0.2))
    await asyncio.sleep(0)
    assert wake.lingering
    await lingering
    assert 0.18 < time.monotonic() - started < 0.2 + 0.2
    assert not wake.lingering
    started = time.monotonic()
    lingering = asyncio.ensure_future(wake.linger(5))
    await asyncio.sleep(0.01)
    wake.kick()
    await asyncio.wait_for(lingering, 1)
    assert time.monotonic() - started < 1 and not wake.lingering
