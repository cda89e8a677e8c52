"""A long fuzz run against a real mesh: hostile bytes and field values at every RPC, for --minutes.

Starts the embedded mesh on the synthetic engine with mutual TLS (`tokenmesh certs` identities), then sends,
from a `client` identity, random serialized messages and random bytes (tests/support/fuzz_targets.py) to the router's
Inference, Router and Control services and to a worker's Worker service, round after round, until the time
is up. It prints the statuses seen per method, and fails (exit 1) if any call ended UNKNOWN or INTERNAL (a
handler broke on its input), if a Control or Worker call was not PERMISSION_DENIED, if any service process
died, or if the mesh no longer serves a generation at the end.

    .venv/bin/python benchmarks/fuzz.py --minutes 10
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
import warnings
from pathlib import Path

import grpc
from common import client_credentials, synthetic_repository
from hypothesis.errors import NonInteractiveExampleWarning
from tests.support.fuzz_targets import BROKEN, TARGETS, WORKER_TARGETS, call, payloads  # root on the path: common

from tokenmesh.certs import make_dev_certs
from tokenmesh.mesh import Mesh, MeshConfig
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc


def serving(channel: grpc.Channel, timeout_s: float = 60) -> None:
    """Until a generation goes through (the workers are routable)."""
    stub = inference_pb2_grpc.InferenceStub(channel)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            list(stub.Generate(inference_pb2.GenerateRequest(prompt="ready?", max_tokens=2), timeout=10))
            return
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to fuzz (default 10)")
    args = parser.parse_args()
    warnings.simplefilter("ignore", NonInteractiveExampleWarning)
    seen: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as folder:
        certs = make_dev_certs(Path(folder) / "certs")
        repository = synthetic_repository(Path(folder), tokens_per_s=2000)
        credentials = client_credentials(str(certs))
        mesh = Mesh(
            MeshConfig(port=0, model_repository=str(repository), tls_dir=str(certs), log_dir=str(Path(folder) / "logs"))
        )
        try:
            mesh.start()
            assert mesh.router is not None
            router = grpc.secure_channel(mesh.router.address, credentials)
            worker = grpc.secure_channel(mesh.workers[0].address, credentials)
            serving(router)
            strategies = [(router, payloads(TARGETS)), (worker, payloads(WORKER_TARGETS))]
            end, calls = time.monotonic() + args.minutes * 60, 0
            while time.monotonic() < end:
                for channel, strategy in strategies:
                    method, kind, data = strategy.example()
                    status = call(channel, method, kind, data)
                    seen[method][status] += 1
                    calls += 1
                    if status in BROKEN:
                        failures.append(f"{method} answered {status} to {data[:60]!r}")
                    if (".Control/" in method or ".Worker/" in method) and status != "PERMISSION_DENIED":
                        failures.append(f"{method} from a client identity answered {status}")
                if calls % 2000 < 2:
                    print(f"  {calls} calls, {max(0, end - time.monotonic()) / 60:.1f} min left", flush=True)
            dead = [c.name for c in mesh.children() if c.proc.poll() is not None]
            if dead:
                failures.append(f"processes died: {', '.join(dead)}")
            stub = inference_pb2_grpc.InferenceStub(router)
            final = list(stub.Generate(inference_pb2.GenerateRequest(prompt="still there?", max_tokens=5), timeout=30))[
                -1
            ]
            if final.finish_reason != inference_pb2.FINISH_REASON_LENGTH:
                failures.append(f"the mesh no longer serves: {final}")
            router.close()
            worker.close()
        finally:
            mesh.stop()
    print(f"\n{calls} calls in {args.minutes:g} min")
    for method, statuses in sorted(seen.items()):
        print(f"  {method:42} " + ", ".join(f"{k} {v}" for k, v in statuses.most_common()))
    for failure in failures[:20]:
        print(f"FAIL: {failure}")
    print(
        "no crash, no broken handler, every Control and Worker call refused"
        if not failures
        else f"{len(failures)} failures"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
