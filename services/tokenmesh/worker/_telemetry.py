"""What a worker measures of itself: token timing, counters and the engine's own queue figures."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tokenmesh.worker._backend import AdapterState, Backend, EngineStats

log = logging.getLogger(__name__)

ENGINE_POLL_S = 1.0
"""Seconds between reads of the engine's queue figures (each is a statistics call and a metrics scrape)."""


def ewma(previous: float | None, value: float, alpha: float = 0.2) -> float:
    """Exponentially weighted moving average (the first value starts it)."""
    return value if previous is None else previous + alpha * (value - previous)


class Telemetry:
    """Moving averages and totals of a worker's generations, and its engine's queue.

    Args:
        backend: the engine whose queue figures :meth:`poll_engine` follows.

    """

    ttft_ms: float | None
    """Moving average of the engine's time to first token."""
    itl_ms: float | None
    """Moving average of the gap between tokens."""
    served_total: int
    """Generations that ended normally."""
    tokens_total: int
    """Tokens of settled generations."""
    engine_poll_s: float
    """Seconds between reads of the engine's queue figures."""
    engine_pending: int | None
    """Requests waiting in the engine's own queue now (None: unknown)."""
    engine_queue_ms: float | None
    """Moving average of the time requests spent in the engine's queue (None: none seen yet)."""
    adapters: AdapterState | None
    """The engine's LoRA adapters as last read (None: it never said; every declared adapter counts as loaded)."""
    _backend: Backend

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self.ttft_ms = None
        self.itl_ms = None
        self.served_total = 0
        self.tokens_total = 0
        self.engine_poll_s = ENGINE_POLL_S
        self.engine_pending = None
        self.engine_queue_ms = None
        self.adapters = None

    def timing(self, ttft_s: float | None, gap_s: float | None) -> None:
        """Fold in a first-token time or an inter-token gap."""
        if ttft_s is not None:
            self.ttft_ms = ewma(self.ttft_ms, ttft_s * 1000)
        if gap_s is not None:
            self.itl_ms = ewma(self.itl_ms, gap_s * 1000)

    async def read_adapters(self) -> None:
        """Take the engine's LoRA adapter state now (None when it does not say, or cannot be read)."""
        try:
            stats = await self._backend.engine_stats()
        except Exception as exc:  # noqa: BLE001 - a restarting engine; the state goes unset
            log.debug("engine stats unavailable: %s", exc)
            stats = None
        self.adapters = stats.adapters if stats is not None else None

    async def poll_engine(self, observe: Callable[[int | None], None] = lambda pending: None) -> None:
        """Follow the engine's own queue figures (Triton's pending count and queue time).

        ``observe(pending)`` is told each read's pending count (the concurrency limit follows it).
        """
        previous: EngineStats | None = None
        while True:
            try:
                stats = await self._backend.engine_stats()
            except Exception as exc:  # noqa: BLE001 - a restarting engine; the figures go unset
                log.debug("engine stats unavailable: %s", exc)
                stats = None
            if stats is None:
                self.engine_pending = None
            else:
                self.engine_pending = stats.pending
                # Kept over a scrape that says nothing of adapters (its metrics fetch failed, or the model has
                # none to publish): the set changes only with a load.
                self.adapters = stats.adapters or self.adapters
                if previous is not None and stats.queued_total > previous.queued_total:
                    mean_ns = (stats.queue_ns_total - previous.queue_ns_total) / (
                        stats.queued_total - previous.queued_total
                    )
                    self.engine_queue_ms = ewma(self.engine_queue_ms, mean_ns / 1e6)
            previous = stats
            observe(self.engine_pending)
            await asyncio.sleep(self.engine_poll_s)
