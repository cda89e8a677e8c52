"""A worker's routing weight: what the prober knows of it, and the function from that to [0, 1]."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenmesh.v1 import router_pb2, worker_pb2

MIN_WEIGHT = 0.05
"""Weight of a serving worker with no free slot (or stale stats): still picked, rarely."""
OOM_PENALTY_S = 30.0
"""For this long after a worker reports a device OOM its weight is halved."""


@dataclass
class WorkerView:
    """What the prober currently knows of one worker."""

    address: str
    reachable: bool = False
    serving: bool = False
    stats: worker_pb2.WorkerStats | None = None
    stats_at: float = 0.0
    rtt_s: float | None = None
    error: str = "not contacted yet"
    oom_at: float = -1e9
    """When the worker's oom_total last rose (time.monotonic())."""
    probed: bool = False
    """A health watch or stats stream answered or failed: the prober knows something of the worker."""
    since: float = field(default_factory=time.monotonic)
    """When the prober began watching it."""


@dataclass(frozen=True)
class Weight:
    """A worker's weight and why."""

    weight: float
    state: router_pb2.WorkerState
    reason: str


def nonsense(stats: worker_pb2.WorkerStats) -> str:
    """Why these stats cannot be true ('' when they can): such a worker is treated as stale."""
    if stats.concurrency_limit == 0:
        return "concurrency_limit 0"
    if stats.in_flight > 1_000_000:
        return f"in_flight {stats.in_flight}"
    for d in stats.devices:
        if d.HasField("memory_total_bytes") and d.memory_used_bytes > d.memory_total_bytes:
            return f"device {d.index} memory used {d.memory_used_bytes} > total {d.memory_total_bytes}"
        if d.HasField("utilization_percent") and d.utilization_percent > 100:
            return f"device {d.index} utilization {d.utilization_percent}%"
    return ""


@dataclass(frozen=True)
class Scoring:
    """Knobs of the weight function (see :func:`compute_weight`)."""

    stale_after_s: float = 1.0
    """Stats older than this count as saturated."""
    memory_threshold: float = 0.92
    """Device memory used/total above this lowers the weight, to 0 at 100%."""
    ttft_slo_ms: float = 2000.0
    """A TTFT average above this scales the weight by slo / ttft."""
    oom_penalty_s: float = OOM_PENALTY_S
    """For this long after a device OOM the weight is halved."""


def compute_weight(view: WorkerView, now: float, scoring: Scoring) -> Weight:
    """Weight of one worker in [0, 1].

    0 unless reachable and SERVING. Otherwise the free fraction of its slots
    (limit - in_flight) / limit, then: x 1/(1 + pending) while Triton's own
    scheduler queue holds requests; x slo/ttft when its TTFT average is over
    the SLO; x (1 - used) / (1 - threshold) for the fullest device over the
    memory threshold; x 0.5 within oom_penalty_s of a device OOM. Stale stats
    count as saturated. A serving worker never drops below MIN_WEIGHT, so it
    still gets work when every worker is busy.
    """
    if not view.reachable:
        return Weight(0.0, router_pb2.WORKER_STATE_UNREACHABLE, f"unreachable: {view.error}")
    if not view.serving:
        why = view.stats.state_reason if view.stats is not None and view.stats.state_reason else ""
        return Weight(0.0, router_pb2.WORKER_STATE_NOT_SERVING, f"health NOT_SERVING: {why or 'starting'}")
    stats = view.stats
    if stats is None or now - view.stats_at > scoring.stale_after_s:
        return Weight(MIN_WEIGHT, router_pb2.WORKER_STATE_SERVING, "serving, stats stale")
    limit = max(stats.concurrency_limit, 1)
    free = max(limit - stats.in_flight, 0)
    weight = free / limit
    reasons = [f"serving, {free}/{limit} slots free"]
    if stats.triton_pending:
        weight /= 1 + stats.triton_pending
        reasons.append(f"{stats.triton_pending} waiting in Triton's queue")
    if stats.HasField("ttft_ms") and stats.ttft_ms > scoring.ttft_slo_ms:
        weight *= scoring.ttft_slo_ms / stats.ttft_ms
        reasons.append(f"TTFT {stats.ttft_ms:.0f} ms > SLO {scoring.ttft_slo_ms:.0f} ms")
    for device in stats.devices:
        if device.HasField("memory_used_bytes") and device.memory_total_bytes:
            used = device.memory_used_bytes / device.memory_total_bytes
            if used > scoring.memory_threshold:
                weight *= max(0.0, (1 - used) / (1 - scoring.memory_threshold))
                reasons.append(f"device {device.index} memory {used:.0%} > {scoring.memory_threshold:.0%}")
    since_oom = now - view.oom_at
    if since_oom < scoring.oom_penalty_s:
        weight /= 2
        reasons.append(f"device out of memory {since_oom:.0f} s ago")
    return Weight(max(round(weight, 2), MIN_WEIGHT), router_pb2.WORKER_STATE_SERVING, ", ".join(reasons))
