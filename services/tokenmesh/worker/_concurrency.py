"""The worker's concurrency limit: how many generations it asks routers for at once.

The limit exists to keep work in the router's priority queue rather than the
engine's FIFO queue, and to back off from real saturation. It is **not**
moved by time to first token: a batching engine's TTFT rises with every
generation it batches, and cutting the limit for that only leaves engine
slots idle while requests wait in the router (measured: 64-slot workers cut
to 1 within 10 s of 16 callers).

- It starts at, and never exceeds, the engine's slots (work beyond them would
  only wait in the engine's queue).
- **Engine queue.** The worker reads the engine's pending count (Triton's
  ``nv_inference_pending_request_count``) every poll. When it stays above 0
  for ``window`` polls in a row, the engine is not taking what it is given:
  the limit drops to what it does run, in flight minus pending (at least
  ``minimum``). Every poll with an empty engine queue adds one back, up to the
  slots. An engine that reports no pending count never lowers the limit.
- **Device memory.** Above ``memory_threshold`` of any device no generation
  is added to those running; below it, at most as many as the free memory up
  to the threshold holds at the memory per generation measured so far (device
  memory in use now minus in use while idle, over the generations running).
  Without device readings (no GPU) there is no memory cap.
- **Device OOM** halves the worker's admission limit (``worker/_limits.py``),
  which bounds this one.

The unloaded TTFT baseline (a slow average of the TTFT of generations that
started with an engine slot free) is still kept, for operators
(``WorkerStats.ttft_baseline_ms``): it does not move the limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmesh.worker._devices import DeviceReading

BASELINE_ALPHA = 0.1


@dataclass
class AdaptiveLimit:
    """Concurrency limit from the engine's own queue and device memory."""

    initial: int
    """Starting limit (the model's slots)."""
    maximum: int
    """Never above this (the engine's slots)."""
    minimum: int = 1
    window: int = 3
    """Engine polls in a row with requests pending before the limit drops."""
    memory_threshold: float = 0.92
    """Device memory fraction above which no generation is added."""
    baseline_ms: float | None = None
    """Moving average of the TTFT of generations that started with a free engine slot (reported only)."""
    _value: int = 0
    _saturated_polls: int = 0
    _idle_memory: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Start at the initial limit, within bounds."""
        self._value = min(max(self.initial, self.minimum), self.maximum)

    @property
    def value(self) -> int:
        """The limit from the engine's queue alone."""
        return self._value

    def resize(self, maximum: int) -> None:
        """The engine's slots changed (models loaded, unloaded or reloaded): the new bound.

        A limit at its old bound (the engine kept up) moves to the new one at once: a worker whose models load
        after its first poll (it starts with 1, the floor of no model at all) serves all its slots as soon as
        they exist, not one more per poll. A limit the engine's queue lowered stays lowered, within the new bound.
        """
        unconstrained = self._value >= self.maximum
        self.maximum = max(maximum, self.minimum)
        self._value = self.maximum if unconstrained else min(self._value, self.maximum)

    def sample(self, ttft_ms: float, queued: bool) -> None:
        """Record one generation's TTFT (``queued``: it started with every engine slot busy); baseline only."""
        if not queued:
            self.baseline_ms = (
                ttft_ms
                if self.baseline_ms is None
                else (self.baseline_ms + BASELINE_ALPHA * (ttft_ms - self.baseline_ms))
            )

    def observe_engine(self, pending: int | None, in_flight: int) -> None:
        """One poll of the engine: ``pending`` requests in its own queue (None: it does not say)."""
        if not pending:
            self._saturated_polls = 0
            self._value = min(self._value + 1, self.maximum)
            return
        self._saturated_polls += 1
        if self._saturated_polls >= self.window:
            self._saturated_polls = 0
            running = max(in_flight - pending, self.minimum)
            self._value = min(self._value, running)

    def limit(self, in_flight: int, devices: Sequence[DeviceReading] = ()) -> int:
        """The limit now: the engine-queue limit, capped by the devices' memory headroom."""
        limit = self.value
        measured = [d for d in devices if d.memory_total_bytes]
        if in_flight == 0:
            self._idle_memory = {d.index: d.memory_used_bytes for d in measured}
        for d in measured:
            headroom = self.memory_threshold * d.memory_total_bytes - d.memory_used_bytes
            if headroom <= 0:
                limit = min(limit, in_flight)
                continue
            idle = self._idle_memory.get(d.index)
            if idle is not None and in_flight > 0 and d.memory_used_bytes > idle:
                per_generation = (d.memory_used_bytes - idle) / in_flight
                limit = min(limit, in_flight + int(headroom // per_generation))
        return max(limit, self.minimum)
