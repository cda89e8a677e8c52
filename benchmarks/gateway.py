"""What the HTTP gateway adds: TTFT and CPU per token, through the gateway (HTTP/SSE) vs straight to the router.

Starts the embedded mesh on the synthetic Triton model (--tokens-per-s per
stream, default 1,000, in --responses-per-s messages, default 200: 5 tokens
each) with its gateway, then runs --blocks blocks per path, alternating which
goes first (each block starts one path later, every other block backwards),
closed loop at --concurrency, the same prompts on every path: ``tokenmesh
bench``'s OpenAI target through the gateway, once per API of --api
(``completions`` by default; ``chat``, ``responses``, ``messages``: the same
stream as chat completions, OpenAI's Responses or Anthropic's Messages, all
parsed as SSE the same way; no ``continuous_usage_stats``, which only chat
and completions have, so every API's events are as plain as an SDK's) and its
mesh target (``tokenmesh.client`` over gRPC to the router). Offered load = concurrency x
tokens-per-s (default 8 x 1,000 = 8k tokens/s). --steps shared (the
default) puts every stream's responses on one step clock, as a batched
engine's decode steps do; --steps per-stream keeps each stream on the phase
of its own start (the worst case for a relay: one wake-up per message).

Prints per API, as the median [min..max] over blocks: the TTFT p50 and p99
that API's path adds over the gRPC path of the same block, and the gateway
process's CPU per token (user + system from /proc over its blocks, divided by
the tokens it relayed); with chat among several APIs, each other API's figures
over chat's. Targets: <= 2 ms TTFT p50 added, <= 30 us CPU per token (issue
13); Responses and Messages within 10% of chat completions (issue 24).

    .venv/bin/python benchmarks/gateway.py
    .venv/bin/python benchmarks/gateway.py --concurrency 5 --steps per-stream
    .venv/bin/python benchmarks/gateway.py --api chat,responses,messages --blocks 2
    GRPC_EXPERIMENTS= .venv/bin/python benchmarks/gateway.py   # the services on gRPC's own defaults
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from common import cpu_seconds, running_mesh, synthetic_repository

from tokenmesh.bench.apis import APIS
from tokenmesh.bench.metrics import RequestResult, summarize
from tokenmesh.bench.prompts import Prompt, synthetic
from tokenmesh.bench.runner import Load, drive
from tokenmesh.bench.targets import MeshTarget, OpenAITarget, Target
from tokenmesh.mesh import MeshConfig


def figures(results: list[RequestResult]) -> dict[str, Any]:
    """TTFT p50/p99 (ms), output tokens, tokens/s and errors (by name) of one block."""
    s = summarize(results)
    return {
        "ttft_p50": s["ttft_s"]["p50"] * 1000,
        "ttft_p99": s["ttft_s"]["p99"] * 1000,
        "tokens": float(s["output_tokens"]),
        "tokens_per_s": s["output_tokens_per_s"],
        "errors": s["errors"],
    }


async def measure(
    router: str, url: str, pids: dict[str, int], args: argparse.Namespace
) -> dict[str, list[dict[str, Any]]]:
    """Blocks of every path, alternated; each block's figures with the CPU seconds of the gateway and router."""
    # No continuous_usage_stats: chat's and completions' events as plain as the others' (and as SDKs ask for them).
    paths: dict[str, Target] = {
        api: OpenAITarget(url, api=api, ignore_eos=True, usage_per_event=False) for api in args.apis
    }
    paths["gRPC"] = MeshTarget(router, ignore_eos=True)
    for target in paths.values():
        await target.open()
    found: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
    try:
        for target in paths.values():  # warm every path (connections, channels, the engines' first requests)
            await drive(target, synthetic(2 * args.concurrency, 16, args.tokens, seed=9), Load(concurrency=8))
        names = list(paths)
        for block in range(args.blocks):
            prompts = synthetic(args.requests, 16, args.tokens, seed=100 + block)
            turn = names[block % len(names) :] + names[: block % len(names)]
            for name in turn if block % 2 == 0 else turn[::-1]:
                found[name].append(await _block(paths[name], prompts, pids, args))
            print(f"  block {block + 1}/{args.blocks} done", flush=True)
    finally:
        for target in paths.values():
            await target.close()
    return found


async def _block(
    target: Target, prompts: list[Prompt], pids: dict[str, int], args: argparse.Namespace
) -> dict[str, Any]:
    """One block of prompts on one path: its figures, each process's CPU seconds, the machine's busy share."""
    before = {name: cpu_seconds([pid]) for name, pid in pids.items()}
    machine, began = psutil.cpu_times(), time.monotonic()
    results = await drive(target, prompts, Load(concurrency=args.concurrency))
    block_figures = figures(results)
    for name, pid in pids.items():
        block_figures[f"{name}_cpu_s"] = cpu_seconds([pid]) - before[name]
    idle = psutil.cpu_times().idle - machine.idle
    block_figures["busy"] = 1 - idle / ((time.monotonic() - began) * (psutil.cpu_count() or 1))
    return block_figures


def spread(values: list[float]) -> str:
    """Median [min..max]."""
    return f"{statistics.median(values):9.3f} [{min(values):.3f}..{max(values):.3f}]"


def report(found: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    """Print the comparison: each API's path against the gRPC path, then against chat completions."""
    direct = found["gRPC"]
    print(
        f"\nsynthetic engine: {args.tokens_per_s:g} tokens/s per stream in {args.responses_per_s:g} messages/s "
        f"({'one step clock for all streams' if args.steps == 'shared' else 'each stream on its own phase'}), "
        f"{args.tokens} tokens per request; concurrency {args.concurrency} "
        f"({args.concurrency * args.tokens_per_s:,.0f} tokens/s offered); {args.blocks} blocks of "
        f"{args.requests} requests per path, alternated"
    )
    print(f"{'':34} " + " ".join(f"{name:>12}" for name in found) + "   (median over blocks)")
    for label, key in (
        ("TTFT p50 (ms)", "ttft_p50"),
        ("TTFT p99 (ms)", "ttft_p99"),
        ("output tokens/s", "tokens_per_s"),
    ):
        print(
            f"{label:34} " + " ".join(f"{statistics.median(b[key] for b in blocks):12.3f}" for blocks in found.values())
        )
    added = {api: _added(found[api], direct) for api in args.apis}
    for api in args.apis:
        print(f"{api} through the gateway, median [min..max] over blocks:")
        for label, values in added[api].items():
            print(f"  {label:32} {spread(values)}")
    for label, values in (
        ("router CPU per token, gRPC (us)", [d["router_cpu_s"] / d["tokens"] * 1e6 for d in direct]),
        ("client CPU per token, gRPC (us)", [d["client_cpu_s"] / d["tokens"] * 1e6 for d in direct]),
        ("machine CPU busy, gRPC (%)", [100 * d["busy"] for d in direct]),
    ):
        print(f"{label:34} {spread(values)}")
    if "chat" in added and len(args.apis) > 1:
        print("over chat completions (the medians above; issue 24's bound: within 10% of chat's):")
        for api in (a for a in args.apis if a != "chat"):
            for label in ("TTFT p50 added by gateway (ms)", "gateway CPU per token (us)"):
                mine, chat = statistics.median(added[api][label]), statistics.median(added["chat"][label])
                print(f"  {api + ', ' + label:48} {mine - chat:+8.3f} ({mine / chat if chat else math.nan:.3f}x)")
    for name, blocks in found.items():
        errors: collections.Counter[str] = collections.Counter()
        for block in blocks:
            errors.update(block["errors"])
        print(f"{'errors, ' + name:34} {sum(errors.values())} {dict(errors) or ''}")


def _added(http: list[dict[str, Any]], direct: list[dict[str, Any]]) -> dict[str, list[float]]:
    """One API's path over the gRPC path, block by block (the blocks ran side by side)."""
    pairs = list(zip(http, direct, strict=True))
    return {
        "TTFT p50 added by gateway (ms)": [h["ttft_p50"] - d["ttft_p50"] for h, d in pairs],
        "TTFT p99 added by gateway (ms)": [h["ttft_p99"] - d["ttft_p99"] for h, d in pairs],
        "gateway CPU per token (us)": [h["gateway_cpu_s"] / h["tokens"] * 1e6 for h in http],
        "gateway CPU, % of a core": [100 * h["gateway_cpu_s"] / (h["tokens"] / h["tokens_per_s"]) for h in http],
        "router CPU per token (us)": [h["router_cpu_s"] / h["tokens"] * 1e6 for h in http],
        "client CPU per token (us)": [h["client_cpu_s"] / h["tokens"] * 1e6 for h in http],
        "machine CPU busy (%)": [100 * h["busy"] for h in http],
    }


def _apis(value: str) -> tuple[str, ...]:
    apis = tuple(dict.fromkeys(a.strip() for a in value.split(",") if a.strip()))
    unknown = [a for a in apis if a not in APIS]
    if not apis or unknown:
        raise argparse.ArgumentTypeError(f"{value!r}: name one or more of {', '.join(APIS)}")
    return apis


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=8, help="streams at once (default 8)")
    parser.add_argument("--blocks", type=int, default=6, help="blocks per path (default 6)")
    parser.add_argument("--requests", type=int, default=64, help="requests per block (default 64)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per request (default 256)")
    parser.add_argument("--tokens-per-s", type=float, default=1000.0, help="per stream (default 1000)")
    parser.add_argument(
        "--responses-per-s",
        type=float,
        default=200.0,
        help="engine messages per second per stream (default 200: 5 tokens each)",
    )
    parser.add_argument("--workers", type=int, default=2, help="workers, each with its own Triton (default 2)")
    parser.add_argument(
        "--api",
        dest="apis",
        type=_apis,
        default=("completions",),
        help="the gateway's APIs to measure, comma-separated, each a path of its own in every block: "
        f"{', '.join(APIS)} (default completions)",
    )
    parser.add_argument(
        "--steps",
        choices=("shared", "per-stream"),
        default="shared",
        help="the engine's responses on one step clock for all streams, as a batched engine's "
        "(default), or each stream on its own phase",
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        repository = synthetic_repository(
            Path(folder),
            tokens_per_s=args.tokens_per_s,
            responses_per_s=args.responses_per_s,
            n_parallel=max(64, args.concurrency),
            shared_steps=int(args.steps == "shared"),
        )
        config = MeshConfig(workers=args.workers, port=0, model_repository=str(repository), gateway_port=0)
        with running_mesh(config) as mesh:
            assert mesh.router is not None and mesh.gateway is not None
            pids = {"gateway": mesh.gateway.proc.pid, "router": mesh.router.proc.pid, "client": os.getpid()}
            found = asyncio.run(measure(mesh.router.address, str(mesh.gateway.info["url"]), pids, args))
    report(found, args)


if __name__ == "__main__":
    main()
