"""Faults on the mesh in network namespaces, at full concurrency: the chaos table.

Runs every service in its own network namespace ("pod") on one bridge, found through a real DNS server and
started with the arguments the Helm chart renders, all at once (tests/support/cluster.py; root, iproute2 and
iptables). --streams callers go through ``tokenmesh.client``, each running generations of --tokens tokens back
to back (so generations also arrive during a fault), --via-gateway of them through the gateway's SSE with
``X-Request-Id`` (resuming with ``Last-Event-ID`` if their connection drops). Each row, mid-stream
(tests/support/chaos.py):

- ``churn``: --churn-streams callers of --churn-tokens tokens while a worker is SIGKILLed and started again every
  10 s (each worker in turn, --churn-kills kills); the note counts the generations streaming at each kill;
- ``kill``: a worker SIGKILLed and started again in its pod at once;
- ``partition``: every packet between the routers and one worker dropped both ways (no RST) for
  --partition-s, then healed;
- ``dns``: the DNS server stopped for --dns-s (discovery keeps what it had);
- ``prober``: the prober cut from the workers (iptables DROP both ways) for --cut-s, then the routers cut from
  the prober for as long (its tables stop; they keep routing on the last one and their own health view);
- ``loss``: --loss of the packets in and out of one worker's pod dropped at random for --loss-s;
- ``latency``: the routers reach one worker through a proxy that adds --delay-ms each way, for --delay-s;
- ``rolling``: every worker restarted one at a time (SIGTERM: it drains), then the prober, then the routers
  one at a time (with two or more), each once the routers route to every worker again;
- ``overload``: --overload-factor x the workers' slots offered at once (after an unloaded run of half of them);
  callers give up at the first refusal, so each refusal is counted with or without its retry hint.

For each row: generations offered, admitted, refused (and refused without a retry hint), broken (an error after
admission, a seq gap or repeat, a wrong token count), moved to another worker, time to detect, failover gap
p50/p99, time to recover, what the row left (stray processes, iptables rules); then what the teardown left
(processes, namespaces, links).

    .venv/bin/python benchmarks/chaos.py --streams 64
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import common  # noqa: F401 - puts the repository root on sys.path for tests.support
from tests.support.chaos import (
    Row,
    churn_row,
    delay_row,
    dns_outage,
    fault_row,
    kill_and_restart,
    overload_row,
    packet_loss,
    prober_cut,
    rolling_row,
    silent_partition,
)
from tests.support.cluster import Cluster, ClusterConfig
from tests.support.netns import why_not_available

ROWS = ("churn", "kill", "partition", "dns", "prober", "loss", "latency", "rolling", "overload")


async def run_row(cluster: Cluster, name: str, victim: int, args: argparse.Namespace) -> list[Row]:
    """One run of the row called name (prober: two rows)."""
    load = {"streams": args.streams, "tokens": args.tokens, "victim": victim, "via_gateway": args.via_gateway}
    if name == "churn":
        churn = {"streams": args.churn_streams, "tokens": args.churn_tokens, "kills": args.churn_kills}
        return [await churn_row(cluster, **churn)]
    if name == "kill":
        return [await fault_row(cluster, "worker SIGKILL+restart", kill_and_restart, **load)]
    if name == "partition":
        return [
            await fault_row(cluster, f"partition {args.partition_s:g} s", silent_partition(args.partition_s), **load)
        ]
    if name == "dns":
        return [await fault_row(cluster, f"DNS down {args.dns_s:g} s", dns_outage(args.dns_s), **load)]
    if name == "prober":
        return [
            await fault_row(
                cluster, f"prober cut from workers {args.cut_s:g} s", prober_cut("workers", args.cut_s), **load
            ),
            await fault_row(
                cluster, f"routers cut from prober {args.cut_s:g} s", prober_cut("routers", args.cut_s), **load
            ),
        ]
    if name == "loss":
        fault = packet_loss(args.loss, args.loss_s)
        return [await fault_row(cluster, f"{args.loss:.0%} loss {args.loss_s:g} s", fault, **load)]
    if name == "latency":
        delay = {"delay_s": args.delay_ms / 1000, "seconds": args.delay_s}
        return [await delay_row(cluster, **delay, **load)]
    if name == "rolling":
        return [await rolling_row(cluster, streams=args.streams, tokens=args.tokens, via_gateway=args.via_gateway)]
    return [await overload_row(cluster, factor=args.overload_factor, tokens=args.overload_tokens)]


async def run_rows(cluster: Cluster, args: argparse.Namespace) -> list[Row]:
    """The rows asked for, in order, each printed as it ends."""
    rows = []
    for name in args.rows.split(","):
        if name not in ROWS:
            raise SystemExit(f"chaos.py: no row {name!r}; rows: {', '.join(ROWS)}")
        for run in range(args.repeat):
            for row in await run_row(cluster, name, run % args.workers, args):
                print(row.line(), flush=True)
                for problem in row.problems:
                    print(f"    broken: {problem}", flush=True)
                for rule in row.rules:
                    print(f"    rule left: {rule}", flush=True)
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
    parser.add_argument(
        "--via-gateway", type=int, default=16, help="of the fault rows' callers, those through the gateway's SSE"
    )
    parser.add_argument("--tokens-per-s", type=float, default=50, help="per generation")
    parser.add_argument("--responses-per-s", type=float, default=10, help="chunks per second per generation")
    parser.add_argument("--partition-s", type=float, default=30)
    parser.add_argument("--churn-streams", type=int, default=16, help="callers of the churn row")
    parser.add_argument("--churn-tokens", type=int, default=4000, help="tokens per generation of the churn row")
    parser.add_argument("--churn-kills", type=int, default=6, help="SIGKILLs of the churn row, 10 s apart")
    parser.add_argument("--dns-s", type=float, default=60, help="how long the DNS server is stopped")
    parser.add_argument("--cut-s", type=float, default=30, help="how long the prober is cut off (each way)")
    parser.add_argument("--loss", type=float, default=0.05, help="fraction of a worker's packets dropped")
    parser.add_argument("--loss-s", type=float, default=30)
    parser.add_argument("--delay-ms", type=float, default=200, help="added each way between routers and a worker")
    parser.add_argument("--delay-s", type=float, default=30)
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
            rows = asyncio.run(run_rows(cluster, args))
            offered, broken = sum(r.offered for r in rows), sum(r.broken for r in rows)
            print(f"{len(rows)} rows, {offered} generations offered, {broken} broken", flush=True)
        finally:
            left = cluster.stop()
        print(f"left behind after the teardown: {', '.join(left) if left else 'nothing'}")


if __name__ == "__main__":
    main()
