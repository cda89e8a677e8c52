"""Triton's Prometheus endpoint: the one gauge the worker reads from it."""

from __future__ import annotations

import urllib.request


def _fetch_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - our own Triton's endpoint
        return str(response.read().decode())


def parse_pending(metrics: str) -> int | None:
    """Sum of ``nv_inference_pending_request_count`` over models in Prometheus text; None if absent."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("nv_inference_pending_request_count{")
    ]
    return int(sum(values)) if values else None
