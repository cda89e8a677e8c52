"""What the router costs per token, and the mesh's throughput against a one-hop relay.

Starts the embedded mesh on the synthetic Triton model (``tokenmesh up
--model synthetic``: 1,000 tokens/s per stream in 5-token responses) and the
baseline from ``relay.py`` (a source streaming the same way, and one Python
grpc.aio relay in front of it). Then, interleaved (relay, mesh, mesh, relay,
...), drives each with --concurrency closed-loop streams of --tokens tokens
through ``Inference/Generate``, and prints per target the output tokens/s and
the CPU per token of the hop in the middle (the router for the mesh, the relay
for the baseline), measured from /proc. Offered load = concurrency x 1,000
tokens/s. Targets: router <= 20 us/token at >= 20k tokens/s offered; mesh
throughput >= 0.8x the relay's.

    .venv/bin/python benchmarks/router_cost.py --concurrency 24
"""

from __future__ import annotations

import argparse
import asyncio

from common import free_port, running_mesh, start_relay, tree_cpu_seconds

from tokenmesh.bench.metrics import RequestResult, summarize
from tokenmesh.bench.prompts import synthetic
from tokenmesh.bench.runner import Load, drive
from tokenmesh.bench.targets import MeshTarget
from tokenmesh.mesh import MeshConfig
from tokenmesh.process import stop_process
from tokenmesh.worker.triton import SHIPPED_REPOSITORIES


async def measure(addr: str, hop_pid: int, args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    """Results and the hop's CPU seconds for one closed-loop run."""
    target = MeshTarget(addr, ignore_eos=True)
    await target.open()
    try:
        prompts = synthetic(args.requests, 16, args.tokens, seed=1)
        await drive(target, prompts[: args.concurrency], Load(concurrency=args.concurrency))  # warm-up
        before = tree_cpu_seconds(hop_pid)
        results = await drive(target, prompts, Load(concurrency=args.concurrency))
        return results, tree_cpu_seconds(hop_pid) - before
    finally:
        await target.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=24, help="streams at once (x 1,000 tokens/s offered)")
    parser.add_argument("--tokens", type=int, default=1000, help="tokens per stream")
    parser.add_argument("--requests", type=int, default=72, help="streams per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs per target, interleaved")
    parser.add_argument("--router-processes", type=int, default=1,
                        help="router processes (their CPU is summed)")
    args = parser.parse_args()

    source_port, relay_port = free_port(), free_port()
    source = start_relay("source", "--port", str(source_port))
    relay = start_relay("relay", "--port", str(relay_port), "--upstream", f"127.0.0.1:{source_port}")
    runs: dict[str, list[tuple[list[RequestResult], float]]] = {"relay": [], "mesh": []}
    try:
        config = MeshConfig(port=0, model_repository=str(SHIPPED_REPOSITORIES["synthetic"]),
                            router_processes=args.router_processes)
        with running_mesh(config) as mesh:
            assert mesh.router is not None
            hops = {"relay": (f"127.0.0.1:{relay_port}", relay.pid),
                    "mesh": (mesh.router.address, mesh.router.proc.pid)}
            for round_ in range(args.rounds):
                for name in (("relay", "mesh") if round_ % 2 == 0 else ("mesh", "relay")):
                    addr, pid = hops[name]
                    runs[name].append(asyncio.run(measure(addr, pid, args)))
                    print(f"  {name}: round {round_ + 1} done", flush=True)
    finally:
        for proc in (relay, source):
            stop_process(proc, 5)

    print(f"\n{args.requests} streams of {args.tokens} tokens per run, concurrency {args.concurrency} "
          f"(offered {args.concurrency * 1000:,} tokens/s), {args.rounds} runs each")
    print(f"{'target':8} {'tokens/s':>10} {'hop us/token':>13} {'interrupted':>12} {'tokens/chunk':>13}")
    rates = {}
    for name, measured in runs.items():
        results = [r for rs, _ in measured for r in rs]
        seconds = sum(summarize(rs)["duration_s"] for rs, _ in measured)
        tokens = sum(r.output_tokens for r in results if r.ok)
        cpu = sum(c for _, c in measured)
        rates[name] = tokens / seconds
        chunk = summarize(results)["tokens_per_chunk"]
        print(f"{name:8} {rates[name]:10.0f} {cpu / tokens * 1e6:13.2f} "
              f"{sum(not r.ok for r in results):>12} {chunk['mean'] if chunk else 0:13.2f}")
    print(f"mesh / relay throughput: {rates['mesh'] / rates['relay']:.3f} (target >= 0.8); "
          "router us/token target <= 20")


if __name__ == "__main__":
    main()
