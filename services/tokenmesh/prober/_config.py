"""The prober's settings."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmesh.config import ServerSettings, address_error, check, check_discovery, csv, setting
from tokenmesh.tls import TlsSettings


@dataclass(frozen=True, kw_only=True)
class ProberConfig(ServerSettings, TlsSettings):
    """Settings of the prober (flags ``--name``, env ``TOKENMESH_PROBER_NAME``)."""

    port: int = setting(50071, "gRPC port (health and reflection only); 0 picks a free one")
    workers: tuple[str, ...] = setting(
        (),
        "worker addresses host:port, comma-separated (with --discovery dns: "
        "DNS names host:port, e.g. a headless Service's)",
        parse=csv,
    )
    routers: tuple[str, ...] = setting(
        (),
        "router addresses host:port to push weights to, comma-separated (with "
        "--discovery dns: DNS names, e.g. the routers' headless Service)",
        parse=csv,
    )
    discovery: str = setting(
        "static",
        "where workers and routers come from: static (the lists as given) or dns "
        "(the addresses behind the names, re-resolved every --discovery-interval-s)",
    )
    discovery_interval_s: float = setting(5.0, "with --discovery dns: seconds between lookups of the names")
    discovery_dns_server: str = setting(
        "",
        "with --discovery dns: the DNS server ip:port to ask; empty = the "
        "system's (/etc/resolv.conf, with its search domains)",
    )
    # 0.5 s, not faster: routers place by their own in-flight counts, so the
    # table need not follow every generation; each ping costs the worker and
    # the prober CPU that, on a small machine, the engine loses (10 pings/s
    # were 1-1.5% of a core each, idle).
    interval_s: float = setting(0.5, "seconds between stats pings to each worker (and weight recomputations)")
    probe_timeout_s: float = setting(1.0, "a ping unanswered this long marks the worker unreachable")
    memory_threshold: float = setting(0.92, "device memory used/total above which a worker's weight falls")
    ttft_slo_ms: float = setting(2000.0, "TTFT objective: a worker averaging more gets weight x slo/ttft")
    # Redeclared: the prober drains nothing (no work in flight), so only health watches wait, and half a second.
    stop_grace_s: float = setting(0.5, "on SIGTERM, how long open calls to the prober (health watches) may take")

    def __post_init__(self) -> None:
        """Validate ranges."""
        self.check_server()
        check(bool(self.workers), "give at least one worker address (--workers host:port,...)")
        check(0 < self.interval_s <= 10, f"interval_s must be in (0, 10], got {self.interval_s}")
        check(self.probe_timeout_s > 0, f"probe_timeout_s must be > 0, got {self.probe_timeout_s}")
        check(0 < self.memory_threshold < 1, f"memory_threshold must be in (0, 1), got {self.memory_threshold}")
        check(self.ttft_slo_ms > 0, f"ttft_slo_ms must be > 0, got {self.ttft_slo_ms}")
        for address in (*self.workers, *self.routers):
            problem = address_error(address)
            check(not problem, f"address {address!r}: {problem}")
        check(self.discovery in ("static", "dns"), f"discovery must be static or dns, got {self.discovery!r}")
        check_discovery(self.discovery_interval_s, self.discovery_dns_server)
        self.check_tls()
