"""Where the mesh's time to first token goes: Triton direct, through a worker, through the router.

Starts the embedded mesh on the synthetic model (5 ms to its first token) and
sends --requests sequential requests of 5 tokens, in turn straight to one
worker's Triton (tritonclient), to that worker (Worker/Generate) and to the
router (Inference/Generate). Prints TTFT p50/min per path: the differences are
what each hop adds to the first token on an idle mesh. For scale, the same for
relay.py's source and one bare grpc.aio relay in front of it (the floor of a
Python hop).

    .venv/bin/python benchmarks/first_token.py --requests 60
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import grpc
from common import free_port, running_mesh, start_relay

from tokenmesh.bench.metrics import RequestResult
from tokenmesh.bench.prompts import Prompt
from tokenmesh.bench.targets import MeshTarget, TritonTarget
from tokenmesh.mesh import MeshConfig
from tokenmesh.process import stop_process
from tokenmesh.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
from tokenmesh.worker.triton import SHIPPED_REPOSITORIES


async def measure(router: str, worker: str, triton_url: str, requests: int) -> dict[str, list[float]]:
    mesh = MeshTarget(router)
    triton = TritonTarget([triton_url], "synthetic")
    await mesh.open()
    await triton.open()
    prompt = Prompt(text="hello there", max_tokens=5)
    seen: dict[str, list[float]] = {"triton": [], "worker": [], "router": []}
    async with grpc.aio.insecure_channel(worker) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        for i in range(requests):
            for name, target in (("triton", triton), ("router", mesh)):
                result = RequestResult(name, time.monotonic())
                await target.run(prompt, result)
                assert result.ttft is not None, result.error
                seen[name].append(result.ttft)
            sent = time.monotonic()
            call = stub.Generate()
            await call.write(
                worker_pb2.WorkerCommand(
                    start=inference_pb2.GenerateRequest(
                        model="synthetic", prompt=prompt.text, max_tokens=5, request_id=f"first-token-{i}"
                    )
                )
            )
            first = None
            async for event in call:
                if first is None and event.HasField("chunk"):
                    first = time.monotonic() - sent
            assert first is not None
            seen["worker"].append(first)
    await mesh.close()
    await triton.close()
    return seen


async def measure_relay(source: str, relay: str, requests: int) -> dict[str, list[float]]:
    targets = {"source": MeshTarget(source), "relay": MeshTarget(relay)}
    seen: dict[str, list[float]] = {name: [] for name in targets}
    for target in targets.values():
        await target.open()
    for _ in range(requests):
        for name, target in targets.items():
            result = RequestResult(name, time.monotonic())
            await target.run(Prompt(text="hello there", max_tokens=5), result)
            assert result.ttft is not None, result.error
            seen[name].append(result.ttft)
    for target in targets.values():
        await target.close()
    return seen


def report(seen: dict[str, list[float]]) -> None:
    base = None
    for name, values in seen.items():
        values = values[10:]
        p50 = statistics.median(values) * 1000
        added = f"  (+{p50 - base:.2f} ms)" if base is not None else ""
        print(f"{name:7} p50 {p50:6.2f} ms  min {min(values) * 1000:6.2f} ms{added}")
        base = p50


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=60, help="requests per path (the first 10 are warm-up)")
    args = parser.parse_args()
    config = MeshConfig(port=0, model_repository=str(SHIPPED_REPOSITORIES["synthetic"]))
    with running_mesh(config) as mesh:
        assert mesh.router is not None
        worker = mesh.workers[0]
        seen = asyncio.run(measure(mesh.router.address, worker.address, str(worker.info["triton_url"]), args.requests))
    source_port, relay_port = free_port(), free_port()
    source = start_relay("source", "--port", str(source_port))
    relay = start_relay("relay", "--port", str(relay_port), "--upstream", f"127.0.0.1:{source_port}")
    try:
        time.sleep(2)  # both listening
        baseline = asyncio.run(measure_relay(f"127.0.0.1:{source_port}", f"127.0.0.1:{relay_port}", args.requests))
    finally:
        for proc in (relay, source):
            stop_process(proc, 5)
    print(f"TTFT of {args.requests - 10} sequential 5-token requests (synthetic model: 5 ms to its first token)")
    report({name: seen[name] for name in ("triton", "worker", "router")})
    print("baseline: relay.py source (first chunk after 5 ms) and one bare grpc.aio relay")
    report(baseline)


if __name__ == "__main__":
    main()
