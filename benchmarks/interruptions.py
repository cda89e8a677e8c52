"""Interruption rate: long streams while workers are killed (SIGKILL) and restarted on a schedule.

Runs the embedded mesh (real Triton + SmolLM2) with --workers workers and
keeps --concurrency long streams (--tokens each, ignore_eos) going until
--streams have run. Every --kill-every seconds one worker (round robin) is
killed with SIGKILL and started again on the same port. Prints the
interruption rate (streams that ended in an error, a seq gap or repeat, or
lost tokens; target 0.000%) and the failover gap (the longest pause between
two chunks of a stream that moved to another worker), p50/p99/max.

    .venv/bin/python benchmarks/interruptions.py --streams 48 --tokens 200
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from common import StreamResult, percentile, run_stream, running_mesh

from tokenmesh.mesh import Mesh, MeshConfig
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc


def chaos(mesh: Mesh, every: float, stop: threading.Event, kills: list[float]) -> None:
    """Kill a worker and start it again on the same port, round robin, until stop."""
    ports = [w.address.rsplit(":", 1)[1] for w in mesh.workers]
    i = 0
    while not stop.wait(every):
        slot = i % len(mesh.workers)
        os.kill(mesh.workers[slot].proc.pid, signal.SIGKILL)
        mesh.workers[slot].proc.wait()
        kills.append(time.monotonic())
        name = f"worker-{slot}-restart-{i}"
        args = [
            "--host",
            "127.0.0.1",
            "--port",
            ports[slot],
            "--threads",
            str(mesh.threads_per_worker),
            "--work-dir",
            str(mesh.run_dir / name),
        ]
        mesh.workers[slot] = mesh.spawn(name, "worker", *args)
        mesh.wait_ready([mesh.workers[slot]])
        i += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--streams", type=int, default=48, help="streams to run in all")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=200, help="tokens per stream (ignore_eos)")
    parser.add_argument("--kill-every", type=float, default=6.0, help="seconds between worker kills")
    args = parser.parse_args()

    env = {"TOKENMESH_ROUTER_TTFT_TIMEOUT_S": "120"}
    with running_mesh(MeshConfig(workers=args.workers, port=0, extra_env=env)) as mesh:
        assert mesh.router is not None
        channel = grpc.insecure_channel(mesh.router.address)
        stub = inference_pb2_grpc.InferenceStub(channel)
        stop, kills = threading.Event(), []
        killer = threading.Thread(target=chaos, args=(mesh, args.kill_every, stop, kills))
        started = time.monotonic()
        killer.start()

        def one(i: int) -> StreamResult:
            request = inference_pb2.GenerateRequest(
                prompt=f"Story {i}: Once upon a time", seed=i, max_tokens=args.tokens, ignore_eos=True
            )
            return run_stream(stub, request, timeout=600)

        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(one, range(args.streams)))
        stop.set()
        killer.join()
        elapsed = time.monotonic() - started
        channel.close()

    interrupted = [r for r in results if r.interrupted]
    moved = [r for r in results if r.migrations]
    failover_gaps = [max(r.gaps) for r in moved if r.gaps]
    all_gaps = [g for r in results for g in r.gaps]
    print(
        f"{len(results)} streams x {args.tokens} tokens, concurrency {args.concurrency}, {args.workers} workers, "
        f"{len(kills)} worker kills (SIGKILL + restart every {args.kill_every:g} s) in {elapsed:.1f} s"
    )
    print(f"interruption rate: {100 * len(interrupted) / len(results):.3f}% ({len(interrupted)}/{len(results)})")
    for r in interrupted[:5]:
        print(f"  interrupted: error={r.error!r} seq_ok={r.seq_ok} tokens={r.tokens}/{r.completion_tokens}")
    print(f"streams moved to another worker: {len(moved)} ({sum(r.migrations for r in moved)} migrations)")
    print(
        f"failover gap (longest pause in a moved stream): p50 {percentile(failover_gaps, 50) * 1000:.0f} ms, "
        f"p99 {percentile(failover_gaps, 99) * 1000:.0f} ms, max {max(failover_gaps, default=0) * 1000:.0f} ms"
    )
    print(
        f"inter-chunk gap, all streams: p50 {percentile(all_gaps, 50) * 1000:.1f} ms, "
        f"p99 {percentile(all_gaps, 99) * 1000:.1f} ms"
    )


if __name__ == "__main__":
    main()
