"""scripts/make_lora.py: a LoRA GGUF that llama.cpp's loader takes for the shipped SmolLM2, the same bytes each time.

What llama.cpp checks when it loads one (src/llama-adapter.cpp): general.type "adapter", the base's
architecture, adapter.type "lora", and per adapted weight W a pair W.lora_a / W.lora_b with
a.ne[0] == W.ne[0], b.ne[1] == W.ne[1], a.ne[1] == b.ne[0]. Loading it for real is tests/integration/test_lora.py's.
"""

from __future__ import annotations

from pathlib import Path

import gguf

from tests.support.lora import make_lora, write_adapter


def test_the_adapter_has_the_keys_and_shapes_llama_cpp_checks(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a.gguf", rank=4, alpha=8.0)
    adapter = gguf.GGUFReader(path)
    base = gguf.GGUFReader(make_lora().shipped_smollm2())
    assert adapter.get_field("general.type").contents() == "adapter"  # type: ignore[union-attr]
    assert adapter.get_field("adapter.type").contents() == "lora"  # type: ignore[union-attr]
    assert adapter.get_field("adapter.lora.alpha").contents() == 8.0  # type: ignore[union-attr]
    arch = base.get_field("general.architecture").contents()  # type: ignore[union-attr]
    assert adapter.get_field("general.architecture").contents() == arch  # type: ignore[union-attr]
    weights = {t.name: [int(n) for n in t.shape] for t in base.tensors}
    pairs = {t.name: [int(n) for n in t.shape] for t in adapter.tensors}
    blocks = sum(1 for name in weights if name.endswith(".attn_q.weight"))
    assert len(pairs) == 2 * 2 * blocks  # attn_q and attn_v of every block, A and B each
    for name, a in pairs.items():
        if not name.endswith(".lora_a"):
            continue
        weight = name.removesuffix(".lora_a")
        b = pairs[f"{weight}.lora_b"]
        assert a[0] == weights[weight][0] and b[1] == weights[weight][1] and a[1] == b[0] == 4


def test_the_same_settings_write_the_same_bytes_and_another_seed_other_ones(tmp_path: Path) -> None:
    first = write_adapter(tmp_path / "first.gguf").read_bytes()
    assert write_adapter(tmp_path / "again.gguf").read_bytes() == first
    assert write_adapter(tmp_path / "other.gguf", seed=1).read_bytes() != first
    assert len(first) < 4 * 1024 * 1024  # rank 8 on two projections: small enough to write in every test session
