"""LoRA adapters on the worker's side: the names it reads, the request it sends, what the SmolLM2 model makes of it.

The model's own code (its model.py) runs here with a stand-in for Triton's Python-backend module; the real
load and a real generation with an adapter are tests/integration/test_lora.py's.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokenmesh.worker import GenerationParams, ModelSpec, parse_adapters
from tokenmesh.worker._servicer import model_infos
from tokenmesh.worker.triton import SHIPPED_REPOSITORIES, build_request, decode_first


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
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _stand_in())
    path = SHIPPED_REPOSITORIES["smollm2"] / "smollm2" / "1" / "model.py"
    spec = importlib.util.spec_from_file_location("smollm2_model_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parse_adapters_reads_the_names_in_order() -> None:
    assert parse_adapters("") == ()
    assert parse_adapters("demo=adapters/demo.gguf, terse = /abs/t.gguf,") == ("demo", "terse")


def test_describe_lists_each_model_then_its_adapters_as_models_of_that_base() -> None:
    specs = [
        ModelSpec(name="smollm2", max_context=2048, slots=4, adapters=("demo", "terse")),
        ModelSpec(name="other", max_context=512, slots=2),
    ]
    assert [(i.name, i.base, i.is_default, i.max_context) for i in model_infos(specs)] == [
        ("smollm2", "", True, 2048),
        ("smollm2:demo", "smollm2", False, 2048),
        ("smollm2:terse", "smollm2", False, 2048),
        ("other", "", False, 512),
    ]


def test_the_request_to_triton_names_the_adapter_as_the_vllm_backend_does() -> None:
    def sampling(params: GenerationParams) -> dict[str, Any]:
        request = build_request(params)
        raw = dict(zip([i.name for i in request.inputs], request.raw_input_contents, strict=True))
        return dict(json.loads(decode_first(raw["sampling_parameters"])))

    assert build_request(GenerationParams(model="smollm2", adapter="demo", prompt="hi")).model_name == "smollm2"
    assert sampling(GenerationParams(model="smollm2", adapter="demo", prompt="hi", max_tokens=5)) == {
        "max_tokens": 5,
        "lora_name": "demo",
    }
    assert "lora_name" not in sampling(GenerationParams(model="smollm2", prompt="hi"))


def test_the_model_applies_the_named_adapter_alone_and_every_other_request_explicitly_without(smollm2: Any) -> None:
    ids = {"demo": 0, "terse": 1}
    named = {"text_input": "hi", "sampling_parameters": json.dumps({"max_tokens": 4, "lora_name": "terse"})}
    body, chat = smollm2._request_body(named, ids)
    assert not chat and body["lora"] == [{"id": 1, "scale": 1.0}] and body["max_tokens"] == 4
    assert "lora_name" not in body
    # A base request on a model with adapters names them at scale 0: without a `lora` list llama.cpp would keep
    # whatever adapter the slot ran last.
    body, _ = smollm2._request_body({"text_input": "hi"}, ids)
    assert body["lora"] == [{"id": 0, "scale": 0.0}]
    body, _ = smollm2._request_body({"text_input": "hi"}, {})
    assert "lora" not in body
    with pytest.raises(ValueError, match=r"unknown LoRA adapter 'nope'; this model loaded: demo, terse"):
        smollm2._request_body({"text_input": "hi", "sampling_parameters": json.dumps({"lora_name": "nope"})}, ids)


def test_the_model_resolves_adapter_paths_against_its_folder_and_names_what_is_wrong(
    smollm2: Any, tmp_path: Path
) -> None:
    (tmp_path / "adapters").mkdir()
    (tmp_path / "adapters" / "demo.gguf").write_bytes(b"GGUF")
    elsewhere = tmp_path / "t.gguf"
    elsewhere.write_bytes(b"GGUF")
    assert smollm2._adapters(f"demo=adapters/demo.gguf,terse={elsewhere}", str(tmp_path)) == [
        ("demo", str(tmp_path / "adapters" / "demo.gguf")),
        ("terse", str(elsewhere)),
    ]
    assert smollm2._adapters("", str(tmp_path)) == []
    with pytest.raises(_ModelException, match=r"'gone': no file .*gone\.gguf"):
        smollm2._adapters("gone=gone.gguf", str(tmp_path))
    with pytest.raises(_ModelException, match=r"'a:b=adapters/demo\.gguf' is not name=path"):
        smollm2._adapters("a:b=adapters/demo.gguf", str(tmp_path))
    with pytest.raises(_ModelException, match=r"'demo' is named twice"):
        smollm2._adapters("demo=adapters/demo.gguf,demo=adapters/demo.gguf", str(tmp_path))
