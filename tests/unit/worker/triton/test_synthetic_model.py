"""The synthetic model's schedule (its model.py, run here with a stand-in for Triton's Python-backend module).

Integration tests run it on a real Triton (tests/integration/test_bench.py);
here only its timing: whether streams share one step clock.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.shipped_models import load_shipped_model
from tokenmesh.worker.triton import SHIPPED_REPOSITORIES

INTERVAL_S = 0.05
"""20 responses/s of 1 token: steps 50 ms apart, wide enough for a shared machine's jitter."""


class _Sender:
    def __init__(self) -> None:
        self.times: list[float] = []
        self.done = threading.Event()

    def send(self, response: Any, flags: int = 0) -> None:
        self.times.append(time.monotonic())
        if flags:
            self.done.set()

    def is_cancelled(self) -> bool:
        return False


class _Request:
    def __init__(self, sender: _Sender, max_tokens: int) -> None:
        self._sender = sender
        self.inputs = {"sampling_parameters": json.dumps({"max_tokens": max_tokens}), "text_input": "a b c"}

    def get_response_sender(self) -> _Sender:
        return self._sender


def _stand_in() -> types.ModuleType:
    """What model.py uses of triton_python_backend_utils."""
    module = types.ModuleType("triton_python_backend_utils")
    module.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1  # type: ignore[attr-defined]
    module.InferenceResponse = lambda **kwargs: kwargs  # type: ignore[attr-defined]
    module.Tensor = lambda name, value: (name, value)  # type: ignore[attr-defined]

    def get_input_tensor_by_name(request: _Request, name: str) -> Any:
        value = request.inputs.get(name)
        return None if value is None else types.SimpleNamespace(as_numpy=lambda: np.array([value.encode()]))

    module.get_input_tensor_by_name = get_input_tensor_by_name  # type: ignore[attr-defined]
    return module


@pytest.fixture
def model_class(monkeypatch: pytest.MonkeyPatch) -> Any:
    return load_shipped_model(monkeypatch, "synthetic", _stand_in()).TritonPythonModel


def _phase_gaps(model_class: Any, shared_steps: str) -> list[float]:
    """Two streams started half a step apart: how far each response of the second is from the first's nearest."""
    model = model_class()
    config = {
        "parameters": {
            k: {"string_value": v}
            for k, v in {
                "tokens_per_s": "20",
                "responses_per_s": "20",
                "ttft_ms": "1",
                "sender_threads": "2",
                "shared_steps": shared_steps,
            }.items()
        }
    }
    model.initialize({"model_config": json.dumps(config)})
    try:
        first, second = _Sender(), _Sender()
        model.execute([_Request(first, 8)])
        time.sleep(INTERVAL_S / 2)
        model.execute([_Request(second, 6)])
        assert first.done.wait(5) and second.done.wait(5)
    finally:
        model.finalize()
    tokens_first, tokens_second = first.times[:-1], second.times[:-1]  # the final response follows at once
    assert (len(tokens_first), len(tokens_second)) == (8, 6)
    return [min(abs(t - u) for u in tokens_first) for t in tokens_second]


def test_shared_steps_put_every_stream_on_one_clock(model_class: Any) -> None:
    assert statistics.median(_phase_gaps(model_class, "1")) < INTERVAL_S / 5


def test_without_shared_steps_each_stream_keeps_the_phase_of_its_start(model_class: Any) -> None:
    assert statistics.median(_phase_gaps(model_class, "0")) > INTERVAL_S / 4


def test_the_shipped_model_keeps_each_streams_phase_by_default() -> None:
    config = (Path(SHIPPED_REPOSITORIES["synthetic"]) / "synthetic" / "config.pbtxt").read_text()
    assert 'key: "shared_steps" value: { string_value: "0" }' in config
