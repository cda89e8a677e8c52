"""Reading Triton's pending-request gauge from its Prometheus text."""

from __future__ import annotations

import pytest

from tokenmesh.worker.triton import parse_metrics, parse_pending

HEADER = (
    "# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution per-model.\n"
    "# TYPE nv_inference_pending_request_count gauge\n"
)
OTHER = (
    "# HELP nv_inference_request_success Number of successful inference requests, all batch sizes\n"
    "# TYPE nv_inference_request_success counter\n"
    'nv_inference_request_success{model="smollm2",version="1"} 41\n'
)


def test_pending_is_summed_over_models_and_other_metrics_are_ignored() -> None:
    text = (
        HEADER
        + 'nv_inference_pending_request_count{model="smollm2",version="1"} 3\n'
        + 'nv_inference_pending_request_count{model="synthetic",version="1"} 2\n'
        + OTHER
    )
    assert parse_pending(text) == 5


def test_a_timestamped_sample_counts_its_value_not_its_timestamp() -> None:
    text = HEADER + 'nv_inference_pending_request_count{model="smollm2",version="1"} 3 1700000000000\n'
    assert parse_pending(text) == 3


def test_absent_metric_is_none_and_zero_is_zero() -> None:
    assert parse_pending(OTHER) is None
    assert parse_pending("") is None
    assert parse_pending(HEADER + 'nv_inference_pending_request_count{model="m",version="1"} 0\n') == 0


def test_text_that_is_not_prometheus_raises_value_error() -> None:
    with pytest.raises(ValueError):
        parse_pending("<html>404 not found</html>")


ADAPTERS = (
    "# HELP tokenmesh_model_adapter_loaded 1 per LoRA adapter loaded\n"
    "# TYPE tokenmesh_model_adapter_loaded gauge\n"
    'tokenmesh_model_adapter_loaded{adapter="a",model="smollm2"} 0\n'
    'tokenmesh_model_adapter_loaded{adapter="b",model="smollm2"} 1\n'
    "# HELP tokenmesh_model_adapter_loads_total LoRA adapter loads\n"
    "# TYPE tokenmesh_model_adapter_loads_total counter\n"
    'tokenmesh_model_adapter_loads_total{adapter="a",model="smollm2"} 2\n'
    'tokenmesh_model_adapter_loads_total{adapter="b",model="smollm2"} 1\n'
    "# HELP tokenmesh_model_adapter_unloads_total LoRA adapter evictions\n"
    "# TYPE tokenmesh_model_adapter_unloads_total counter\n"
    'tokenmesh_model_adapter_unloads_total{adapter="a",model="smollm2"} 2\n'
    'tokenmesh_model_adapter_unloads_total{adapter="b",model="smollm2"} 0\n'
)


def test_the_models_adapter_metrics_give_the_loaded_set_and_the_load_counts() -> None:
    pending, adapters = parse_metrics(HEADER + 'nv_inference_pending_request_count{model="smollm2"} 1\n' + ADAPTERS)
    assert pending == 1 and adapters is not None
    assert adapters.reporting == {"smollm2"} and adapters.loaded == {("smollm2", "b")}
    assert adapters.loads == {("smollm2", "a"): 2, ("smollm2", "b"): 1}
    assert adapters.unloads == {("smollm2", "a"): 2, ("smollm2", "b"): 0}
    assert parse_metrics(OTHER) == (None, None)  # no model reports adapters: every declared one counts as loaded
