"""Prometheus metrics every service shares: buckets, bounded labels, the HTTP endpoint.

Names follow Prometheus' conventions (``tokenmesh_`` prefix, seconds, ``_total``
counters). Labels are bounded: model, worker address, priority, outcome, and
``tenant`` only from an allow-list (``--metrics-tenants``), every other tenant
counted as ``other``. State that a scrape can read (in flight, limits,
weights, queue) is read at scrape time by a collector, not updated per event,
so it costs the hot path nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)

TTFT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    60.0,
    120.0,
)
"""Time to first token: 1 ms (the synthetic engine, a warm prefix) to 60 s+ (a long prompt behind a queue);
the GenAI semantic conventions' advice, extended down for a mesh that adds milliseconds."""
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
"""Inter-token latency and time per output token: 1 ms to 2.5 s (vLLM's buckets)."""
REQUEST_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
)
"""End-to-end and queue times: 10 ms to 32 min."""
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
"""Prompt and output lengths in tokens."""

OTHER_TENANT = "other"
MAX_LABEL_CHARS = 64


class TenantLabel:
    """The tenant label value for a request: allow-listed names as they are, everything else ``other``.

    A caller-chosen label must never grow the series count (or carry 10 MB, or
    control characters, into a label): only names on the operator's list are
    kept, and only printable ones of at most MAX_LABEL_CHARS.

    Args:
        allowed: the tenants that get their own series.

    """

    _allowed: frozenset[str]

    def __init__(self, allowed: Iterable[str]) -> None:
        self._allowed = frozenset(t for t in allowed if t.isprintable() and len(t) <= MAX_LABEL_CHARS)

    def __call__(self, tenant: str) -> str:
        """The label value for tenant."""
        return tenant if tenant in self._allowed else OTHER_TENANT


class MetricsEndpoint:
    """``/metrics`` over HTTP from a daemon thread (prometheus_client's WSGI server), until :meth:`close`.

    Args:
        registry: what to serve.
        host: address to listen on.
        port: port to listen on (0 picks a free one; see :attr:`port`).
        service: the service's name, in the log line.

    """

    port: int
    _server: Any

    def __init__(self, registry: CollectorRegistry, host: str, port: int, service: str) -> None:
        try:
            self._server, _ = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise OSError(
                f"cannot serve metrics on {host}:{port} ({exc.strerror or exc}); choose another "
                "--metrics-port (0 turns metrics off)"
            ) from None
        self.port = int(self._server.server_port)
        log.info("%s metrics on http://%s:%d/metrics", service, host, self.port)

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
