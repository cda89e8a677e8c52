"""Triton's Prometheus endpoint: the one gauge the worker reads from it."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

PENDING = "nv_inference_pending_request_count"
"""Triton's gauge of requests waiting in a model's queue, one sample per model (and version)."""


def _fetch_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - our own Triton's endpoint
        return str(response.read().decode())


def parse_pending(metrics: str) -> int | None:
    """Sum of ``nv_inference_pending_request_count`` over models in Prometheus text; None if absent.

    Raises:
        ValueError: the text is not Prometheus exposition format.

    """
    values = [
        sample.value
        for family in text_string_to_metric_families(metrics)
        if family.name == PENDING
        for sample in family.samples
        if sample.name == PENDING
    ]
    return int(sum(values)) if values else None
