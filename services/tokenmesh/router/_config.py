"""The router's settings."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmesh.config import ServerSettings, address_error, check, check_discovery, csv, setting
from tokenmesh.router._pool import POLICIES
from tokenmesh.router._quota_file import load_quotas
from tokenmesh.tls import TlsSettings

WORKER_LINK = ("auto", "off")
"""How a router's generations reach their workers (RouterConfig.worker_link)."""

DISCOVERY = ("static", "dns", "prober")
"""Where a router's workers come from (RouterConfig.discovery)."""


@dataclass(frozen=True, kw_only=True)
class RouterConfig(ServerSettings, TlsSettings):
    """Settings of one router (flags ``--name``, env ``TOKENMESH_ROUTER_NAME``)."""

    port: int = setting(50051, "gRPC port; 0 picks a free one")
    workers: tuple[str, ...] = setting(
        (),
        "worker addresses host:port, comma-separated (with --discovery dns: "
        "DNS names host:port, e.g. a headless Service's)",
        parse=csv,
    )
    discovery: str = setting(
        "static",
        "where workers come from: static (only --workers; a weight table naming "
        "another worker is refused), dns (the addresses behind the --workers names, "
        "re-resolved every --discovery-interval-s; one that goes is drained) or "
        "prober (the prober's tables may add workers)",
    )
    discovery_interval_s: float = setting(5.0, "with --discovery dns: seconds between lookups of the names")
    discovery_dns_server: str = setting(
        "",
        "with --discovery dns: the DNS server ip:port to ask; empty = the "
        "system's (/etc/resolv.conf, with its search domains)",
    )
    metrics_tenants: tuple[str, ...] = setting(
        (),
        "tenants (labels['tenant']) that get their own metric label, "
        "comma-separated; every other tenant counts as 'other'",
        parse=csv,
    )
    default_max_tokens: int = setting(256, "max_tokens when a request leaves it unset")
    max_prompt_bytes: int = setting(1024 * 1024, "largest prompt (or sum of message contents) accepted, in bytes")
    ttft_timeout_s: float = setting(30.0, "a worker that sends no first chunk within this is failed over")
    stall_timeout_s: float = setting(
        5.0,
        "a worker silent this long between chunks is failed over (a generation silent on a worker that sends others' "
        "chunks is slow, not stalled: it moves after --ttft-timeout-s)",
    )
    max_migrations: int = setting(
        3,
        "times in a row one generation may move to (or be retried on) another worker with no chunk delivered in "
        "between (a move after progress starts the count again)",
    )
    failover_wait_s: float = setting(30.0, "how long a stream whose worker failed waits for another live worker")
    worker_link: str = setting(
        "auto",
        "auto: each generation goes to its worker on one shared Worker/Link call per worker (batched chunks, "
        "per-generation credit), Worker/Generate for workers that do not serve Link; off: one Worker/Generate "
        "call per generation (the rollback switch)",
    )
    stream_interval_ms: int = setting(
        0,
        "at most one chunk per generation per this many milliseconds to its caller, as vLLM's --stream-interval: "
        "the worker merges what the engine produces meanwhile (fewer, larger messages on every hop); the first "
        "chunk and the end are never held. 0: every chunk as it comes. Must be below --stall-timeout-s",
    )
    policy: str = setting(
        "prefix",
        "worker selection: prefix (KV-cache affinity: labels['session'], else the prompt prefix), least-loaded, "
        "round-robin",
    )
    max_streams_per_connection: int = setting(
        1024,
        "streams one caller connection may have open at once "
        "(HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS); more are refused "
        "with UNAVAILABLE (never started: retry). Bounds what one "
        "caller makes the router hold",
    )
    stream_linger_us: int = setting(
        1000,
        "on a busy Inference/GenerateStream call (its previous message left less than this ago) with 2 or more "
        "streams, wait up to this long (0-1000 us) for more of them to have a chunk before a send holds fewer "
        "chunks than streams (never with one stream alone, never on a quiet call)",
    )
    max_queue: int = setting(256, "generations that may wait for a worker slot; more get RESOURCE_EXHAUSTED")
    queue_timeout_s: float = setting(30.0, "longest wait for a worker slot before RESOURCE_EXHAUSTED")
    aging_s: float = setting(5.0, "a waiting generation rises one priority level per this many seconds")
    drain_grace_s: float = setting(30.0, "on SIGTERM, how long in-flight generations may take to finish")
    processes: int = setting(
        1,
        "router processes sharing the port (SO_REUSEPORT); each worker's limit is "
        "split among them and weight tables are passed on to all; with --metrics-port P, "
        "process i serves its metrics on P + i",
    )
    process_index: int = setting(0, "internal: which of the --processes this one is (the first starts the others)")
    peers_dir: str = setting("", "internal: folder where the processes of one router list their private addresses")
    quota_file: str = setting(
        "",
        "per-tenant quotas (tokens and requests per minute, concurrent generations), TOML, reloaded when it "
        "changes (docs/quotas.md); empty = no quota",
    )
    quota_window_s: float = setting(
        60.0, "the quotas' window in seconds (their 'minute'; every router sharing --quota-redis-url the same)"
    )
    quota_redis_url: str = setting(
        "",
        "redis://host:port/db that every router shares the quotas' counts in; empty = this router counts alone. "
        "While it is down each router grants its share of each quota (the quota / the routers last counted)",
    )
    tls_allowed_clients: tuple[str, ...] = setting(
        (),
        "with --tls-mode mtls: the identities (URI SANs, e.g. "
        "spiffe://tokenmesh/client) that may call Inference, "
        "comma-separated; empty = any the CA signed",
        parse=csv,
    )

    def __post_init__(self) -> None:
        """Validate ranges."""
        self.check_server()
        check(self.ttft_timeout_s > 0, f"ttft_timeout_s must be > 0, got {self.ttft_timeout_s}")
        check(self.stall_timeout_s > 0, f"stall_timeout_s must be > 0, got {self.stall_timeout_s}")
        check(self.max_migrations >= 0, f"max_migrations must be >= 0, got {self.max_migrations}")
        check(self.failover_wait_s >= 0, f"failover_wait_s must be >= 0, got {self.failover_wait_s}")
        check(
            0 <= self.stream_interval_ms < self.stall_timeout_s * 1000,
            f"stream_interval_ms must be >= 0 and below stall_timeout_s ({self.stall_timeout_s:g} s: a paced "
            f"stream would look stalled), got {self.stream_interval_ms}",
        )
        check(self.worker_link in WORKER_LINK, f"worker_link must be auto or off, got {self.worker_link!r}")
        check(self.policy in POLICIES, f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        check(0 <= self.stream_linger_us <= 1000, f"stream_linger_us must be 0..1000, got {self.stream_linger_us}")
        check(self.max_queue >= 0, f"max_queue must be >= 0, got {self.max_queue}")
        check(
            self.max_streams_per_connection >= 1,
            f"max_streams_per_connection must be >= 1, got {self.max_streams_per_connection}",
        )
        check(self.queue_timeout_s > 0, f"queue_timeout_s must be > 0, got {self.queue_timeout_s}")
        check(self.aging_s > 0, f"aging_s must be > 0, got {self.aging_s}")
        check(self.drain_grace_s >= 0, f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        check(self.default_max_tokens > 0, f"default_max_tokens must be > 0, got {self.default_max_tokens}")
        check(self.max_prompt_bytes > 0, f"max_prompt_bytes must be > 0, got {self.max_prompt_bytes}")
        check(1 <= self.processes <= 64, f"processes must be 1..64, got {self.processes}")
        check(
            0 <= self.process_index < self.processes,
            f"process_index must be 0..{self.processes - 1}, got {self.process_index}",
        )
        check(self.discovery in DISCOVERY, f"discovery must be one of {', '.join(DISCOVERY)}, got {self.discovery!r}")
        for address in self.workers:
            problem = address_error(address)
            check(not problem, f"worker address {address!r}: {problem}")
        check_discovery(self.discovery_interval_s, self.discovery_dns_server)
        check(self.quota_window_s > 0, f"quota_window_s must be > 0, got {self.quota_window_s}")
        check(
            not self.quota_redis_url or self.quota_redis_url.startswith(("redis://", "rediss://", "unix://")),
            f"quota_redis_url must start with redis://, rediss:// or unix://, got {self.quota_redis_url!r}",
        )
        if self.quota_file:
            load_quotas(self.quota_file)  # a mistake in it stops the router at start, naming the line
        self.check_tls()
        check(
            bool(self.workers) or self.discovery == "prober",
            "give at least one worker (--workers host:port,...), or --discovery prober to learn them from "
            "the prober's weight tables",
        )
