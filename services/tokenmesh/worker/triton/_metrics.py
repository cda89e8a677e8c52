"""Triton's Prometheus endpoint: what the worker reads from it (its pending gauge, the models' adapter metrics)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tokenmesh.worker._backend import AdapterKey, AdapterState

PENDING = "nv_inference_pending_request_count"
"""Triton's gauge of requests waiting in a model's queue, one sample per model (and version)."""
ADAPTER_LOADED = "tokenmesh_model_adapter_loaded"
"""The SmolLM2 model's custom gauge (Triton python-backend metric): 1 per LoRA adapter loaded, by model and adapter."""
ADAPTER_LOADS = "tokenmesh_model_adapter_loads_total"
"""Its counter of adapter loads."""
ADAPTER_UNLOADS = "tokenmesh_model_adapter_unloads_total"
"""Its counter of adapter evictions."""


def _fetch_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - our own Triton's endpoint
        return str(response.read().decode())


def parse_metrics(metrics: str) -> tuple[int | None, AdapterState | None]:
    """The pending count summed over models, and the models' adapter state, from Prometheus text (one pass).

    None for either when the text has none of it (adapters: no model reports the loaded gauge).

    Raises:
        ValueError: the text is not Prometheus exposition format.

    """
    pending: list[float] = []
    found: dict[str, dict[AdapterKey, int]] = {ADAPTER_LOADED: {}, ADAPTER_LOADS: {}, ADAPTER_UNLOADS: {}}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == PENDING:
                pending.append(sample.value)
            elif sample.name in found:
                key = (sample.labels.get("model", ""), sample.labels.get("adapter", ""))
                found[sample.name][key] = int(sample.value)
    loaded = found[ADAPTER_LOADED]
    adapters = None
    if loaded:
        adapters = AdapterState(
            reporting=frozenset(model for model, _ in loaded),
            loaded=frozenset(k for k, v in loaded.items() if v),
            loads=found[ADAPTER_LOADS],
            unloads=found[ADAPTER_UNLOADS],
        )
    return (int(sum(pending)) if pending else None), adapters


def parse_pending(metrics: str) -> int | None:
    """Sum of ``nv_inference_pending_request_count`` over models in Prometheus text; None if absent.

    Raises:
        ValueError: the text is not Prometheus exposition format.

    """
    return parse_metrics(metrics)[0]
