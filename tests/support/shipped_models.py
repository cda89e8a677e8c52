"""A shipped Triton model's model.py loaded as a module, with a stand-in for Triton's Python-backend module.

For unit tests of a model's own logic: no Triton, no engine call.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest

from tokenmesh.worker.triton import SHIPPED_REPOSITORIES


def load_shipped_model(monkeypatch: pytest.MonkeyPatch, name: str, stand_in: types.ModuleType) -> types.ModuleType:
    """The shipped model ``name``'s model.py, importing stand_in as ``triton_python_backend_utils``."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stand_in)
    path = SHIPPED_REPOSITORIES[name] / name / "1" / "model.py"
    spec = importlib.util.spec_from_file_location(f"{name}_model_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
