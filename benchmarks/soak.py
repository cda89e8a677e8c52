"""Soak: router and worker memory before and after many streams.

Runs the embedded mesh (real Triton + SmolLM2), warms up, reads the RSS of
the router and of each worker process (Triton's separately), runs --streams
short generations at --concurrency, then reads them again (and once more
after the workers' resume grace period). Targets: router growth < 5 MB,
worker growth < 20 MB.

    .venv/bin/python benchmarks/soak.py --streams 5000
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from common import rss_mb, run_stream, running_mesh, tree_rss_mb

from tokenmesh.mesh import Mesh, MeshConfig
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc


def snapshot(mesh: Mesh) -> dict[str, float]:
    assert mesh.router is not None
    values = {"router": rss_mb(mesh.router.proc.pid)}
    for w in mesh.workers:
        values[w.name] = rss_mb(w.proc.pid)
        values[f"{w.name} triton+stub"] = tree_rss_mb(int(w.info["triton_pid"]))
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--streams", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=300)
    args = parser.parse_args()

    with running_mesh(MeshConfig(workers=args.workers, port=0)) as mesh:
        assert mesh.router is not None
        channel = grpc.insecure_channel(mesh.router.address)
        stub = inference_pb2_grpc.InferenceStub(channel)

        def one(i: int) -> bool:
            request = inference_pb2.GenerateRequest(prompt=f"Item {i}:", max_tokens=args.tokens, seed=i)
            return not run_stream(stub, request, timeout=120).interrupted

        with ThreadPoolExecutor(args.concurrency) as pool:
            assert all(pool.map(one, range(args.warmup))), "warm-up streams failed"
            time.sleep(2)
            before = snapshot(mesh)
            started = time.monotonic()
            ok = sum(pool.map(one, range(args.streams)))
            elapsed = time.monotonic() - started
        time.sleep(2)
        after = snapshot(mesh)
        time.sleep(35)  # past the resume grace period: every record is gone
        settled = snapshot(mesh)
        channel.close()

    print(
        f"{args.streams} streams ({ok} ok) x {args.tokens} tokens at concurrency {args.concurrency} "
        f"in {elapsed:.1f} s ({args.streams / elapsed:.0f} streams/s), after {args.warmup} warm-up streams"
    )
    print(f"{'process':22} {'before MB':>10} {'after MB':>10} {'growth MB':>10} {'+35 s MB':>10}")
    for name in before:
        print(
            f"{name:22} {before[name]:10.1f} {after[name]:10.1f} {after[name] - before[name]:10.1f} "
            f"{settled[name]:10.1f}"
        )


if __name__ == "__main__":
    main()
