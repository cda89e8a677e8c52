"""How many generations a worker accepts, and how many it asks routers for.

Two limits. The **admission limit** is what ``Worker/Generate`` accepts at
once: the engine's slots plus a queue as deep (``QUEUE_FACTOR`` x slots); a
device out-of-memory halves it from what was running (multiplicative
decrease), and it grows back by one per ``OOM_RECOVERY_S`` (additive
increase). The **concurrency limit** is what the worker reports to the prober
and routers: the engine-queue/memory limit (:mod:`._concurrency`), never above
the admission limit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from tokenmesh.worker._backend import Backend
from tokenmesh.worker._concurrency import AdaptiveLimit
from tokenmesh.worker._devices import DeviceReading

log = logging.getLogger(__name__)

QUEUE_FACTOR = 4
"""Generations admitted per model slot (the rest wait in the engine's queue)."""
OOM_RECOVERY_S = 10.0
"""After a device OOM the admission limit grows back by one per this many seconds."""


class Limits:
    """The worker's admission and concurrency limits.

    Args:
        backend: the engine (its models' slots bound both limits).
        memory_threshold: device memory fraction above which no generation is added.

    """

    oom_total: int
    """Device out-of-memory errors seen."""
    lowered: int | None
    """Admission limit while lowered after a device OOM; None = QUEUE_FACTOR x slots."""
    last_oom: float
    """time.monotonic() of the latest device OOM."""
    device_readings: Sequence[DeviceReading]
    """The latest device readings (the memory cap of the adaptive limit)."""
    _backend: Backend
    _memory_threshold: float
    _adaptive: AdaptiveLimit | None

    def __init__(self, backend: Backend, memory_threshold: float) -> None:
        self._backend = backend
        self._memory_threshold = memory_threshold
        self._adaptive = None
        self.oom_total = 0
        self.lowered = None
        self.last_oom = 0.0
        self.device_readings = ()

    def slots(self) -> int:
        """Generations the models run at once (sum of their slots)."""
        return sum(spec.slots for spec in self._backend.models()) or 1

    def admission_limit(self) -> int:
        """Most generations accepted at once: the slots plus a queue as deep, or less after an OOM."""
        full = QUEUE_FACTOR * self.slots()
        if self.lowered is None:
            return full
        # Additive increase: one more every OOM_RECOVERY_S without another OOM.
        grown = self.lowered + int((time.monotonic() - self.last_oom) / OOM_RECOVERY_S)
        if grown >= full:
            self.lowered = None
            return full
        return grown

    def adaptive(self) -> AdaptiveLimit:
        """The engine-queue- and memory-driven limit, bounded by the slots of the models loaded now.

        The slots are read on every call, not once: the first call often comes before the engine has loaded
        anything (a prober's first Stats poll, long before Triton is ready), and models load, unload and reload
        (a Triton restart) while the worker runs.
        """
        slots = self.slots()
        if self._adaptive is None:
            self._adaptive = AdaptiveLimit(initial=slots, maximum=slots, memory_threshold=self._memory_threshold)
        elif self._adaptive.maximum != slots:
            self._adaptive.resize(slots)
        return self._adaptive

    def concurrency_limit(self, in_flight: int) -> int:
        """Generations the worker should run at once: adaptive, never above the admission limit."""
        return min(self.adaptive().limit(in_flight, self.device_readings), self.admission_limit())

    def out_of_memory(self, in_flight: int, shed: Callable[[int], None]) -> None:
        """A device ran out of memory: halve the admission limit from what was running.

        ``shed(limit)`` is then asked to shed generations still waiting for
        their first token, so that at most ``limit`` remain (they run elsewhere).
        """
        self.oom_total += 1
        self.last_oom = time.monotonic()
        self.lowered = max(1, min(self.admission_limit(), in_flight) // 2)
        shed(self.lowered)
        log.warning("device out of memory: admission limit now %d (%d OOMs)", self.lowered, self.oom_total)
