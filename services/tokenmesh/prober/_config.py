"""The prober's settings."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmesh.config import address_error, check, csv, setting


@dataclass(frozen=True, kw_only=True)
class ProberConfig:
    """Settings of the prober (flags ``--name``, env ``TOKENMESH_PROBER_NAME``)."""

    host: str = setting("127.0.0.1", "address to listen on (health and reflection only)")
    port: int = setting(50071, "gRPC port; 0 picks a free one")
    workers: tuple[str, ...] = setting((), "worker addresses host:port, comma-separated", parse=csv)
    routers: tuple[str, ...] = setting((), "router addresses host:port to push weights to, comma-separated", parse=csv)
    # 0.5 s, not faster: routers place by their own in-flight counts, so the
    # table need not follow every generation; each ping costs the worker and
    # the prober CPU that, on a small machine, the engine loses (10 pings/s
    # were 1-1.5% of a core each, idle).
    interval_s: float = setting(0.5, "seconds between stats pings to each worker (and weight recomputations)")
    probe_timeout_s: float = setting(1.0, "a ping unanswered this long marks the worker unreachable")
    memory_threshold: float = setting(0.92, "device memory used/total above which a worker's weight falls")
    ttft_slo_ms: float = setting(2000.0, "TTFT objective: a worker averaging more gets weight x slo/ttft")
    stop_grace_s: float = setting(0.5, "on SIGTERM, how long open calls to the prober (health watches) may take")
    ready_file: str = setting("", "write {address, pid} as JSON here once running")

    def __post_init__(self) -> None:
        """Validate ranges."""
        check(0 <= self.port <= 65535, f"port must be 0..65535, got {self.port}")
        check(bool(self.workers), "give at least one worker address (--workers host:port,...)")
        check(0 < self.interval_s <= 10, f"interval_s must be in (0, 10], got {self.interval_s}")
        check(self.probe_timeout_s > 0, f"probe_timeout_s must be > 0, got {self.probe_timeout_s}")
        check(0 < self.memory_threshold < 1, f"memory_threshold must be in (0, 1), got {self.memory_threshold}")
        check(self.ttft_slo_ms > 0, f"ttft_slo_ms must be > 0, got {self.ttft_slo_ms}")
        check(self.stop_grace_s >= 0, f"stop_grace_s must be >= 0, got {self.stop_grace_s}")
        for address in (*self.workers, *self.routers):
            problem = address_error(address)
            check(not problem, f"address {address!r}: {problem}")
