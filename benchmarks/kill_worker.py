"""How fast the mesh stops routing to a worker killed with SIGKILL.

Starts the embedded mesh (real Triton + SmolLM2), kills one worker with
SIGKILL, and prints the time until the router's table shows its weight at 0,
then whether new generations succeed on the survivors. Repeats --runs times.

    .venv/bin/python benchmarks/kill_worker.py --runs 3
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time

import grpc

from tokenmesh.mesh import Mesh, MeshConfig
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, router_pb2, router_pb2_grpc


def one_run(workers: int) -> tuple[float, int]:
    with tempfile.TemporaryDirectory() as logs, Mesh(MeshConfig(workers=workers, port=0, log_dir=logs)) as mesh:
        assert mesh.router is not None
        with grpc.insecure_channel(mesh.router.address) as channel:
            table = router_pb2_grpc.RouterStub(channel).GetRoutingTable
            deadline = time.monotonic() + 30
            while sum(w.weight > 0 for w in table(router_pb2.GetRoutingTableRequest()).workers) < workers:
                if time.monotonic() > deadline:
                    raise SystemExit("workers never all became routable")
                time.sleep(0.05)
            victim = mesh.workers[0]
            killed = time.monotonic()
            os.kill(victim.proc.pid, signal.SIGKILL)
            while True:
                rows = table(router_pb2.GetRoutingTableRequest()).workers
                if next(w.weight for w in rows if w.address == victim.address) == 0:
                    break
                time.sleep(0.001)
            elapsed = time.monotonic() - killed
            ok = 0
            stub = inference_pb2_grpc.InferenceStub(channel)
            for i in range(8):
                request = inference_pb2.GenerateRequest(prompt="Hi", max_tokens=4, seed=i)
                chunks = list(stub.Generate(request, timeout=60))
                ok += chunks[-1].finish_reason != inference_pb2.FINISH_REASON_UNSPECIFIED
            return elapsed, ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    times = []
    for run in range(1, args.runs + 1):
        elapsed, ok = one_run(args.workers)
        times.append(elapsed)
        print(f"run {run}: weight 0 after {elapsed * 1000:.1f} ms; 8/8 new generations -> {ok}/8 succeeded")
    print(
        f"time to weight 0: median {statistics.median(times) * 1000:.1f} ms, max {max(times) * 1000:.1f} ms "
        f"over {len(times)} runs ({args.workers} workers)"
    )


if __name__ == "__main__":
    main()
