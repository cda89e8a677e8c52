"""Reading Triton's pending-request gauge from its Prometheus text."""

from __future__ import annotations

import pytest

from tokenmesh.worker.triton import parse_pending

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
