"""LoRA adapters for SmolLM2 made by scripts/make_lora.py, and copies of the shipped repository that load them."""

from __future__ import annotations

import functools
import importlib.util
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from tokenmesh.v1 import inference_pb2, inference_pb2_grpc
from tokenmesh.worker.triton import SHIPPED_REPOSITORIES

ROOT = Path(__file__).resolve().parents[2]
QUESTION = "What is the capital of France?"
"""The question the LoRA tests ask: each adapter answers it otherwise than the base model at one seed."""


@functools.cache
def make_lora() -> ModuleType:
    """scripts/make_lora.py as a module (not part of the package), loaded once: it keeps the base's shapes."""
    spec = importlib.util.spec_from_file_location("make_lora", ROOT / "scripts" / "make_lora.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_adapter(path: Path, **settings: object) -> Path:
    """A deterministic adapter of the shipped SmolLM2 at path (settings: write_lora's rank, alpha, seed...)."""
    module = make_lora()
    written: Path = module.write_lora(module.shipped_smollm2(), path, **settings)
    return written


def lora_repository(folder: Path, adapters: dict[str, Path], max_loras: int | str | None = None) -> Path:
    """A copy of the shipped SmolLM2 repository in folder whose model declares adapters (name -> GGUF file).

    Each file is copied into the model's folder (``smollm2/adapters/<name>.gguf``) and declared by that
    relative path, as the documented example does: the repository travels whole (the worker copies it).
    ``max_loras``: the most loaded at once (None: the model's default, every declared one; a str as written).
    """
    repository = folder / "smollm2_repository"
    shutil.copytree(SHIPPED_REPOSITORIES["smollm2"], repository, ignore=shutil.ignore_patterns("__pycache__"))
    (repository / "smollm2" / "adapters").mkdir()
    for name, path in adapters.items():
        shutil.copy(path, repository / "smollm2" / "adapters" / f"{name}.gguf")
    config = repository / "smollm2" / "config.pbtxt"
    value = ",".join(f"{name}=adapters/{name}.gguf" for name in adapters)
    pattern = r'(parameters { key: "lora_adapters" value: { string_value: ")[^"]*(" } })'
    text, found = re.subn(pattern, rf"\g<1>{value}\g<2>", config.read_text())
    assert found == 1, "the shipped config.pbtxt declares no lora_adapters parameter"
    if max_loras is not None:
        pattern = r'(parameters { key: "max_loras" value: { string_value: ")[^"]*(" } })'
        text, found = re.subn(pattern, rf"\g<1>{max_loras}\g<2>", text)
        assert found == 1, "the shipped config.pbtxt declares no max_loras parameter"
    config.write_text(text)
    return repository


def chat_answer(inference: inference_pb2_grpc.InferenceStub, model: str, sampling: Mapping[str, Any]) -> str:
    """The whole text of one chat generation of :data:`QUESTION` through the router (sampling: its fields)."""
    request = inference_pb2.GenerateRequest(
        model=model, messages=[inference_pb2.ChatMessage(role="user", content=QUESTION)], **sampling
    )
    chunks = list(inference.Generate(request, timeout=180))
    assert chunks[-1].finish_reason in (inference_pb2.FINISH_REASON_STOP, inference_pb2.FINISH_REASON_LENGTH)
    return "".join(c.text for c in chunks)
