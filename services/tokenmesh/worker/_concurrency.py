"""The worker's adaptive concurrency limit: how many generations it should be given at once.

AIMD on time to first token against the worker's unloaded baseline:

- The **unloaded baseline** is a slow moving average of the TTFT of
  generations that started while the engine had a free slot (so none of their
  TTFT was spent queued behind other generations).
- Every ``window`` TTFT samples, the window's p90 (the tail is where queueing
  shows) is compared with it: ``gradient = clamp(tolerance x baseline / p90,
  0.5, 1)``. Up to ``tolerance`` times the baseline is not congestion
  (prompt lengths differ).
- Without congestion the limit grows by one per window (additive increase);
  with it, it is multiplied by the gradient (multiplicative decrease, at most
  halved). The limit moves a ``smoothing`` fraction toward that and stays
  within [``minimum``, ``maximum``]; the maximum is the engine's slots, since
  work beyond them would only wait in the engine's FIFO queue, where the
  router's priority queue serves it better.
- **GPU memory headroom caps it**: above ``memory_threshold`` of any device no
  generation is added to those running; below it, at most as many as the free
  memory up to the threshold holds at the memory per generation measured so
  far (device memory in use now minus in use while idle, over the generations
  running). Without device readings (no GPU) there is no memory cap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmesh.worker._devices import DeviceReading

MIN_GRADIENT = 0.5
BASELINE_ALPHA = 0.1


@dataclass
class AdaptiveLimit:
    """Gradient limit on TTFT against the unloaded baseline, capped by device memory."""

    initial: int
    """Starting limit (the model's slots)."""
    maximum: int
    """Never above this (the engine's slots)."""
    minimum: int = 1
    tolerance: float = 2.0
    """TTFT up to this many times the baseline is not congestion."""
    window: int = 8
    """TTFT samples per update."""
    smoothing: float = 0.5
    memory_threshold: float = 0.92
    """Device memory fraction above which no generation is added."""
    baseline_ms: float | None = None
    _estimate: float = 0.0
    _samples: list[float] = field(default_factory=list)
    _idle_memory: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Start at the initial limit, within bounds."""
        self._estimate = float(min(max(self.initial, self.minimum), self.maximum))

    @property
    def value(self) -> int:
        """The limit from latency alone."""
        return int(self._estimate)

    def sample(self, ttft_ms: float, queued: bool) -> None:
        """Record one generation's TTFT; ``queued``: it started with every engine slot busy."""
        if not queued:
            self.baseline_ms = ttft_ms if self.baseline_ms is None else (
                self.baseline_ms + BASELINE_ALPHA * (ttft_ms - self.baseline_ms))
        self._samples.append(ttft_ms)
        if len(self._samples) < self.window:
            return
        ordered = sorted(self._samples)
        tail = ordered[int(0.9 * (len(ordered) - 1))]
        self._samples.clear()
        if self.baseline_ms is None or tail <= 0:
            return
        gradient = max(MIN_GRADIENT, min(1.0, self.tolerance * self.baseline_ms / tail))
        new = self._estimate + 1 if gradient >= 1.0 else self._estimate * gradient
        estimate = (1 - self.smoothing) * self._estimate + self.smoothing * new
        self._estimate = min(max(estimate, float(self.minimum)), float(self.maximum))

    def limit(self, in_flight: int, devices: Sequence[DeviceReading] = ()) -> int:
        """The limit now: the latency limit, capped by the devices' memory headroom."""
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
