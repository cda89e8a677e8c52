"""Faults mid-stream on the mesh in network namespaces, callers through ``tokenmesh.client``: none breaks a stream.

The short version of ``benchmarks/chaos.py``'s rows (16 callers where it runs 64, each running generations back
to back): a worker SIGKILLed and started again, a silent partition between the router and a worker (packets
dropped both ways, no RST), and 3x the mesh's slots offered at once.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from tests.support.chaos import Row, fault_row, kill_and_restart, overload_row, silent_partition
from tests.support.cluster import GATEWAY_PORT, Cluster

pytestmark = pytest.mark.integration

STREAMS = 16
"""Callers, so generations in flight, during a fault: two workers' slots (8 each) hold them all when the third is
lost."""
TOKENS = 200
"""Tokens per generation: 4 s at the cluster's 50 tokens/s."""
PARTITION_S = 8.0
"""Longer than the router's stall timeout (5 s), so the streams must move while the partition lasts."""
DETECT_S = 10.0
"""A silent partition is detected, and its streams moved, within this."""


def report(row: Row) -> None:
    print(f"\n{Row.HEADER}\n{row.line()}")  # noqa: T201 - the row's figures, with pytest -s
    for problem in row.problems:
        print(f"  broken: {problem}")  # noqa: T201


def test_every_pod_serves_as_the_chart_runs_it_found_through_dns(cluster: Cluster) -> None:
    worker_name = "tm-tokenmesh-worker-headless.chaos.svc.cluster.local:50061"
    for router in cluster.routers:
        rows = {w.address: w for w in cluster.table(router).workers}
        assert sorted(rows) == sorted(w.address for w in cluster.workers)
        assert {w.found_by for w in rows.values()} == {f"dns {worker_name}"}
        assert {w.concurrency_limit for w in rows.values()} == {cluster.config.slots}
    # The gateway found the routers by the router Service's name, through its pod's resolv.conf.
    gateway = f"http://{cluster.services['gateway'].pod.address}:{GATEWAY_PORT}"
    body = json.dumps({"model": "synthetic", "prompt": "hello", "max_tokens": 5, "ignore_eos": True}).encode()
    post = urllib.request.Request(f"{gateway}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(post, timeout=30) as answer:  # noqa: S310 - the gateway pod
        completion = json.loads(answer.read())
    assert completion["usage"]["completion_tokens"] == 5, completion


def test_a_worker_sigkilled_and_restarted_mid_stream_breaks_no_stream(cluster: Cluster) -> None:
    row = asyncio.run(fault_row(cluster, "worker SIGKILL+restart", kill_and_restart, streams=STREAMS, tokens=TOKENS))
    report(row)
    assert row.offered >= STREAMS and row.admitted == row.offered and row.broken == 0, row.problems
    assert row.moved > 0, "no generation ran on the killed worker"
    assert row.detect_s is not None and row.detect_s < DETECT_S
    assert row.recover_s is not None, "the restarted worker was not routed to again"
    assert not row.strays, f"processes left in the pods: {row.strays}"


def test_a_silent_partition_between_router_and_worker_breaks_no_stream(cluster: Cluster) -> None:
    fault = silent_partition(PARTITION_S)
    row = asyncio.run(fault_row(cluster, "silent partition", fault, streams=STREAMS, tokens=TOKENS))
    report(row)
    assert row.offered >= STREAMS and row.admitted == row.offered and row.broken == 0, row.problems
    assert row.moved > 0, "no generation ran on the partitioned worker"
    assert row.detect_s is not None and row.detect_s <= DETECT_S
    assert row.gap_p99_s is not None and row.gap_p99_s <= DETECT_S
    assert row.recover_s is not None, "the healed worker was not routed to again"
    assert not row.strays


def test_overload_refuses_the_excess_with_a_hint_and_breaks_no_admitted_stream(cluster: Cluster) -> None:
    row = asyncio.run(overload_row(cluster, factor=3, tokens=TOKENS))
    report(row)
    slots = cluster.config.slots * len(cluster.workers)
    assert row.offered == 3 * slots
    assert row.broken == 0, row.problems
    assert row.admitted >= slots, "the mesh refused work it had slots for"
    assert row.refused == row.offered - row.admitted > 0
    assert row.refused_without_hint == 0, "a refusal without a retry hint"
    assert row.moved == 0, "an admitted stream was moved: the mesh's own lag read as a stalled worker"
    assert not row.strays
