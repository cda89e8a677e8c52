"""LoRA adapters for SmolLM2 made by scripts/make_lora.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def make_lora() -> ModuleType:
    """scripts/make_lora.py as a module (a script, not part of the package)."""
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
