"""The gateway's settings."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmesh.config import address_error, check, csv, setting
from tokenmesh.tls import TlsSettings
from tokenmesh_gateway._auth import load_keys
from tokenmesh_gateway._cors import origin_error


@dataclass(frozen=True, kw_only=True)
class GatewayConfig(TlsSettings):
    """Settings of one gateway (flags ``--name``, env ``TOKENMESH_GATEWAY_NAME``)."""

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "HTTP port; 0 picks a free one")
    health_port: int = setting(
        0,
        "also serve GET /health alone, plaintext HTTP, on this port, for kubelet probes (which present no "
        "client certificate, so with --tls-mode mtls they cannot reach the HTTPS port); 0 = off",
    )
    metrics_port: int = setting(0, "serve Prometheus metrics on http://host:PORT/metrics; 0 = off")
    routers: tuple[str, ...] = setting(
        (),
        "router addresses host:port, comma-separated, or one DNS name whose "
        "A records are the routers; a stream whose router fails resumes on "
        "another",
        parse=csv,
    )
    api_keys_file: str = setting(
        "",
        "file of accepted API keys, one 'sha256hex tenant' per line ('#' starts a "
        "comment); when set, every /v1 call needs 'Authorization: Bearer KEY' and its "
        "tenant becomes the generation's tenant label; empty = no keys",
    )
    cors_origins: tuple[str, ...] = setting(
        (),
        "origins (scheme://host[:port], comma-separated) whose browser pages may call the gateway: their "
        "requests get Access-Control-Allow-Origin and their preflights (OPTIONS) are answered; other "
        "origins get neither; empty = no CORS",
        parse=csv,
    )
    default_model: str = setting("", "model for requests that name none; empty = the mesh's default model")
    max_body_bytes: int = setting(1024 * 1024, "largest request body, in bytes; a larger one gets 413")
    max_header_bytes: int = setting(
        32 * 1024, "largest request line plus headers, in bytes; more gets 431 and the connection closed"
    )
    keepalive_s: float = setting(
        15.0, "a stream silent this long gets a ': keep-alive' comment line (proxies drop idle connections)"
    )
    timeout_s: float = setting(
        0.0,
        "longest a generation may take, retries and resumes included (504 before "
        "the first chunk, an error event after); 0 = no limit",
    )
    retry_deadline_s: float = setting(
        10.0,
        "how long a request may be retried on other routers before its first "
        "chunk, and a broken stream be resumed, before the caller gets the error",
    )
    max_resumes: int = setting(8, "times one stream may be resumed on another router after its stream broke")
    drain_grace_s: float = setting(
        30.0,
        "on SIGTERM, how long open streams may take to finish (new requests get "
        "503 meanwhile); streams still open then end with an error event",
    )
    drain_tail_s: float = setting(
        2.0,
        "after drain_grace_s, how long the streams it ended get to write their "
        "error event before the HTTP server stops",
    )
    stop_grace_s: float = setting(
        2.0, "once the HTTP server stops, how long answers still being written get before their connections are closed"
    )
    responses_retention_s: float = setting(
        600.0,
        "how long a background response (POST /v1/responses with background: true) is kept from its creation, "
        "retrievable and resumable; one still running then is cancelled",
    )
    responses_max: int = setting(
        1000, "most background responses one gateway keeps at once (memory: their text); more get 429"
    )
    ready_file: str = setting("", "write {address, url, pid} as JSON here once serving")

    def __post_init__(self) -> None:
        """Validate ranges."""
        check(0 <= self.port <= 65535, f"port must be 0..65535, got {self.port}")
        for name, extra in (("health_port", self.health_port), ("metrics_port", self.metrics_port)):
            check(0 <= extra <= 65535, f"{name} must be 0..65535, got {extra}")
            check(not extra or extra != self.port, f"{name} must differ from port ({self.port}); 0 turns it off")
        check(
            not self.health_port or self.health_port != self.metrics_port,
            f"health_port and metrics_port must differ (both {self.health_port})",
        )
        for origin in self.cors_origins:
            problem = origin_error(origin)
            check(not problem, f"cors_origins: {origin!r} {problem}")
        check(bool(self.routers), "give at least one router address (--routers host:port,...)")
        for address in self.routers:
            problem = address_error(address)
            check(not problem, f"router address {address!r}: {problem}")
        check(
            1024 <= self.max_body_bytes <= 64 * 1024 * 1024,
            f"max_body_bytes must be 1024..67108864, got {self.max_body_bytes}",
        )
        check(
            1024 <= self.max_header_bytes <= 1024 * 1024,
            f"max_header_bytes must be 1024..1048576, got {self.max_header_bytes}",
        )
        check(0 < self.keepalive_s <= 3600, f"keepalive_s must be in (0, 3600], got {self.keepalive_s}")
        check(self.timeout_s >= 0, f"timeout_s must be >= 0 (0 = no limit), got {self.timeout_s}")
        check(self.retry_deadline_s > 0, f"retry_deadline_s must be > 0, got {self.retry_deadline_s}")
        check(self.max_resumes >= 0, f"max_resumes must be >= 0, got {self.max_resumes}")
        check(self.drain_grace_s >= 0, f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        check(self.drain_tail_s >= 0, f"drain_tail_s must be >= 0, got {self.drain_tail_s}")
        check(self.responses_retention_s > 0, f"responses_retention_s must be > 0, got {self.responses_retention_s}")
        check(self.responses_max >= 1, f"responses_max must be >= 1, got {self.responses_max}")
        check(self.stop_grace_s >= 0, f"stop_grace_s must be >= 0, got {self.stop_grace_s}")
        if self.api_keys_file:
            load_keys(self.api_keys_file)  # a bad file stops the start, with the line at fault
        self.check_tls()  # HTTPS on the port (mtls: client certificates required), and TLS to the routers
