"""What the mesh adds to direct Triton, on an engine quiet enough to decide it.

SmolLM2's own TTFT noise on this machine is 100x the mesh's overhead, so this
uses the synthetic Triton model with a fixed TTFT (--ttft-ms, default 20) and
per-stream rate (--tokens-per-s, default 200, one token per response): the
engine's time is the same on both sides to within a fraction of a
millisecond. Starts the embedded mesh (2 workers) on it, then at each
--levels concurrency runs --blocks blocks per target, alternating which goes
first (ABBA), closed loop, the same prompts on both sides: the mesh
(through ``tokenmesh.client``: with --api stream, its default, every request on
one shared ``Inference/GenerateStream`` call; with --api generate, one
``Inference/Generate`` call each) and direct Triton (``stream_infer`` to
the workers' Tritons, each request to the one with the fewest outstanding).

The router reads its environment (``TOKENMESH_ROUTER_STREAM_INTERVAL_MS=20``
paces the mesh's chunks; the ITL rows show it).

Prints per level: TTFT p50 and p99 overhead (mesh - direct, ms), TPOT ratio,
output throughput ratio, each as the median over blocks with its min..max
spread, so the reader sees whether a difference is beyond the noise. Targets
(issue 11): at concurrency 1 and 8, TTFT p50 overhead <= 2 ms, p99 <= 5 ms,
throughput ratio >= 0.98.

    .venv/bin/python benchmarks/overhead.py
    .venv/bin/python benchmarks/overhead.py --levels 1,8,64 --blocks 6 --ttft-ms 20
    .venv/bin/python benchmarks/overhead.py --levels 8,64 --api generate
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path
from typing import Any

from common import running_mesh, synthetic_repository

from tokenmesh.bench.metrics import RequestResult, summarize
from tokenmesh.bench.prompts import synthetic
from tokenmesh.bench.runner import Load, drive
from tokenmesh.bench.targets import MeshTarget, Target, TritonTarget
from tokenmesh.mesh import MeshConfig


def block_figures(results: list[RequestResult]) -> dict[str, float]:
    """The per-block figures compared: TTFT p50/p99, ITL p50/p99, TPOT mean (ms), output tokens/s, errors."""
    s = summarize(results)
    itl = s["itl_s"] or {"p50": 0.0, "p99": 0.0}  # none when every request came in one chunk
    return {
        "ttft_p50": s["ttft_s"]["p50"] * 1000,
        "ttft_p99": s["ttft_s"]["p99"] * 1000,
        "itl_p50": itl["p50"] * 1000,
        "itl_p99": itl["p99"] * 1000,
        "tpot": s["tpot_s"]["mean"] * 1000,
        "tokens_per_s": s["output_tokens_per_s"],
        "errors": float(s["requests"] - s["successful"]),
    }


def requests_for(concurrency: int, per_slot: int) -> int:
    """Requests per block: enough for a p99 at concurrency 1, per_slot per stream slot above."""
    return max(40, per_slot * concurrency)


async def measure(mesh_addr: str, args: argparse.Namespace) -> dict[int, dict[str, list[dict[str, float]]]]:
    """Blocks per level and target, alternated."""
    mesh = MeshTarget(mesh_addr, ignore_eos=True, batched=args.api == "stream")
    await mesh.open()
    direct = TritonTarget(await mesh.triton_endpoints(), mesh.model, ignore_eos=True)
    await direct.open()
    targets: tuple[Target, Target] = (mesh, direct)
    found: dict[int, dict[str, list[dict[str, float]]]] = {}
    try:
        for target in targets:  # warm both paths (channels, Triton's first requests)
            await drive(target, synthetic(16, 16, args.tokens, seed=9), Load(concurrency=8))
        for level in args.levels:
            found[level] = {t.name: [] for t in targets}
            count = requests_for(level, args.per_slot)
            for block in range(args.blocks):
                prompts = synthetic(count, 16, args.tokens, seed=100 * level + block)
                for target in targets if block % 2 == 0 else targets[::-1]:
                    results = await drive(target, prompts, Load(concurrency=level))
                    found[level][target.name].append(block_figures(results))
            print(f"  concurrency {level}: {args.blocks} blocks of {count} requests per target done", flush=True)
    finally:
        await mesh.close()
        await direct.close()
    return found


def spread(values: list[float]) -> str:
    """Median [min..max]."""
    return f"{statistics.median(values):8.3f} [{min(values):.3f}..{max(values):.3f}]"


def report(found: dict[int, dict[str, list[dict[str, float]]]], args: argparse.Namespace) -> dict[str, Any]:
    """Print the comparison per level; return it."""
    print(
        f"\nsynthetic engine: TTFT {args.ttft_ms:g} ms, {args.tokens_per_s:g} tokens/s per stream, "
        f"{args.tokens} tokens per request; {args.blocks} blocks per target, alternated"
    )
    print("per level: median over blocks [min..max over blocks]")
    document: dict[str, Any] = {}
    for level, blocks in found.items():
        mesh, direct = blocks["mesh"], blocks["triton"]
        pairs = list(zip(mesh, direct, strict=True))
        rows = {
            "TTFT p50 overhead (ms)": [m["ttft_p50"] - d["ttft_p50"] for m, d in pairs],
            "TTFT p99 overhead (ms)": [m["ttft_p99"] - d["ttft_p99"] for m, d in pairs],
            "TPOT ratio": [m["tpot"] / d["tpot"] for m, d in pairs],
            "throughput ratio": [m["tokens_per_s"] / d["tokens_per_s"] for m, d in pairs],
        }
        print(f"\n== concurrency {level} ==")
        print(f"{'':24} {'mesh':>10} {'direct':>10}   mesh vs direct")
        for label, key in (
            ("TTFT p50 (ms)", "ttft_p50"),
            ("TTFT p99 (ms)", "ttft_p99"),
            ("ITL p50 (ms)", "itl_p50"),  # a chunk's gap: the interval, with the router's --stream-interval-ms
            ("ITL p99 (ms)", "itl_p99"),
            ("TPOT (ms)", "tpot"),
            ("output tokens/s", "tokens_per_s"),
        ):
            print(
                f"{label:24} {statistics.median(m[key] for m in mesh):10.3f} "
                f"{statistics.median(d[key] for d in direct):10.3f}"
            )
        for label, values in rows.items():
            print(f"{label:24} {spread(values)}")
        errors = sum(m["errors"] for m in mesh), sum(d["errors"] for d in direct)
        print(f"{'errors (mesh, direct)':24} {errors[0]:.0f}, {errors[1]:.0f}")
        document[str(level)] = {"rows": rows, "mesh": mesh, "direct": direct}
    return document


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--levels",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 8, 64],
        help="concurrency levels, comma-separated (default 1,8,64)",
    )
    parser.add_argument("--blocks", type=int, default=6, help="blocks per target and level (default 6)")
    parser.add_argument(
        "--per-slot",
        type=int,
        default=4,
        help="requests per block per unit of concurrency (at least 40 per block; default 4)",
    )
    parser.add_argument(
        "--tokens", type=int, default=128, help="tokens per request (default 128, as tokenmesh bench's --output-tokens)"
    )
    parser.add_argument("--ttft-ms", type=float, default=20.0, help="the synthetic engine's TTFT (default 20)")
    parser.add_argument(
        "--tokens-per-s", type=float, default=200.0, help="tokens per second per stream, one per response (default 200)"
    )
    parser.add_argument("--workers", type=int, default=2, help="workers, each with its own Triton (default 2)")
    parser.add_argument(
        "--steps",
        choices=("own", "shared"),
        default="own",
        help="the synthetic engine's responses: each stream on its own phase (default), or every stream's on one "
        "step clock, as a batched engine's (both sides get the same engine)",
    )
    parser.add_argument("--json", default="", help="write every block's figures here")
    parser.add_argument(
        "--api",
        choices=("stream", "generate"),
        default="stream",
        help="the mesh's caller: stream = one GenerateStream call per router for every request (the client's "
        "default); generate = one Generate call per request (default stream)",
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        repository = synthetic_repository(
            Path(folder),
            ttft_ms=args.ttft_ms,
            tokens_per_s=args.tokens_per_s,
            responses_per_s=args.tokens_per_s,
            n_parallel=max(64, *args.levels),
            shared_steps=int(args.steps == "shared"),
        )
        config = MeshConfig(workers=args.workers, port=0, model_repository=str(repository))
        with running_mesh(config) as mesh:
            assert mesh.router is not None
            found = asyncio.run(measure(mesh.router.address, args))
    document = report(found, args)
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(document, indent=1))


if __name__ == "__main__":
    main()
