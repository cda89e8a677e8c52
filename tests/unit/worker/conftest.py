"""The shipped SmolLM2 model.py loaded as a module, for tests of its own logic (no Triton, no llama.cpp call)."""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest

from tests.support.shipped_models import load_shipped_model


class _ModelException(Exception):
    pass


def _stand_in() -> types.ModuleType:
    """What the SmolLM2 model.py uses of triton_python_backend_utils at import and in _request_body."""
    module = types.ModuleType("triton_python_backend_utils")
    module.TritonModelException = _ModelException  # type: ignore[attr-defined]

    def get_input_tensor_by_name(request: dict[str, str], name: str) -> Any:
        value = request.get(name)
        return None if value is None else types.SimpleNamespace(as_numpy=lambda: np.array([value.encode()]))

    module.get_input_tensor_by_name = get_input_tensor_by_name  # type: ignore[attr-defined]
    return module


@pytest.fixture
def smollm2(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The shipped SmolLM2 model.py as a module."""
    return load_shipped_model(monkeypatch, "smollm2", _stand_in())
