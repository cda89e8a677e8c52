"""Faults on the mesh in network namespaces, at full concurrency: the chaos table.

Runs every service in its own network namespace ("pod") on one bridge, found through a real DNS server and
started with the arguments the Helm chart renders (tests/support/cluster.py; root, iproute2 and iptables).
--streams callers go through ``tokenmesh.client``, each running generations of --tokens tokens back to back
(so generations also arrive during a fault). Each row, mid-stream:

- ``kill``: a worker SIGKILLed and started again in its pod at once;
- ``partition``: every packet between the routers and one worker dropped both ways (no RST) for
  --partition-s, then healed;
- ``overload``: --overload-factor x the workers' slots offered at once (after an unloaded run of half of them);
  callers give up at the first refusal, so each refusal is counted with or without its retry hint.

For each row: generations offered, admitted, refused (and refused without a retry hint), broken (an error after
admission, a seq gap or repeat, a wrong token count), moved to another worker, time to detect, failover gap
p50/p99, time to recover, stray processes; then what the teardown left (processes, namespaces, links).

    .venv/bin/python benchmarks/chaos.py --streams 64 --partition-s 30
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import common  # noqa: F401 - puts the repository root on sys.path for tests.support
from tests.support.chaos import Row, fault_row, kill_and_restart, overload_row, silent_partition
from tests.support.cluster import Cluster, ClusterConfig
from tests.support.netns import why_not_available

ROWS = ("kill", "partition", "overload")


async def run_rows(cluster: Cluster, args: argparse.Namespace) -> list[Row]:
    """The rows asked for, in order, each printed as it ends."""
    rows = []
    for name in args.rows.split(","):
        for run in range(args.repeat):
            load = {"streams": args.streams, "tokens": args.tokens, "victim": run % args.workers}
            if name == "kill":
                row = await fault_row(cluster, "worker SIGKILL+restart", kill_and_restart, **load)
            elif name == "partition":
                fault = silent_partition(args.partition_s)
                row = await fault_row(cluster, f"partition {args.partition_s:g} s", fault, **load)
            else:
                row = await overload_row(cluster, factor=args.overload_factor, tokens=args.overload_tokens)
            print(row.line(), flush=True)
            for problem in row.problems:
                print(f"    broken: {problem}", flush=True)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each row (the fault rows: each worker in turn)")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--routers", type=int, default=2)
    parser.add_argument("--slots", type=int, default=32, help="slots per worker (the synthetic model's n_parallel)")
    parser.add_argument("--max-queue", type=int, default=32, help="chart value router.maxQueue")
    parser.add_argument("--streams", type=int, default=64, help="callers (generations in flight) of the fault rows")
    parser.add_argument("--tokens", type=int, default=500, help="tokens per generation of the fault rows")
    parser.add_argument("--tokens-per-s", type=float, default=50, help="per generation")
    parser.add_argument("--responses-per-s", type=float, default=10, help="chunks per second per generation")
    parser.add_argument("--partition-s", type=float, default=30)
    parser.add_argument("--overload-factor", type=int, default=3)
    parser.add_argument("--overload-tokens", type=int, default=300)
    parser.add_argument("--log-dir", default="", help="services' logs (default: a temporary folder)")
    args = parser.parse_args()
    reason = why_not_available()
    if reason:
        sys.exit(f"chaos.py: {reason}")
    with tempfile.TemporaryDirectory() as scratch:
        config = ClusterConfig(
            log_dir=Path(args.log_dir or scratch),
            workers=args.workers,
            routers=args.routers,
            slots=args.slots,
            max_queue=args.max_queue,
            tokens_per_s=args.tokens_per_s,
            responses_per_s=args.responses_per_s,
        )
        cluster = Cluster(config)
        try:
            cluster.start()
            print(
                f"{args.workers} workers x {args.slots} slots, {args.routers} router(s), prober, gateway; "
                f"{args.streams} callers, generations of {args.tokens} tokens at {args.tokens_per_s:g} tokens/s",
                flush=True,
            )
            print(Row.HEADER, flush=True)
            asyncio.run(run_rows(cluster, args))
        finally:
            left = cluster.stop()
        print(f"left behind after the teardown: {', '.join(left) if left else 'nothing'}")


if __name__ == "__main__":
    main()
