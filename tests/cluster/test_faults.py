"""Faults mid-stream on the mesh in network namespaces, callers through ``tokenmesh.client``: none breaks a stream.

The short version of ``benchmarks/chaos.py``'s rows (16 callers where it runs 64, each running generations back
to back): a worker SIGKILLed and started again (once, and every 10 s), a silent partition between the router and
a worker (packets dropped both ways, no RST), 3x the mesh's slots offered at once, the DNS server stopped, the
prober cut from the workers and from the router, 5% packet loss on a worker's pod, 200 ms added each way between
the router and a worker, and a rolling restart of the workers, the prober and the gateway; callers of the kill
and the rolling restart also through the gateway's SSE with ``X-Request-Id``.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

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
from tests.support.cluster import GATEWAY_PORT, Cluster

pytestmark = pytest.mark.integration

STREAMS = 16
"""Callers, so generations in flight, during a fault: two workers' slots (8 each) hold them all when the third is
lost."""
TOKENS = 200
"""Tokens per generation: 4 s at the cluster's 50 tokens/s."""
PARTITION_S = 8.0
"""Longer than the router's stall timeout (5 s), so the streams must move while the partition lasts."""
VIA_GATEWAY = 4
"""Of the callers, those through the gateway's SSE with X-Request-Id (the kill and the rolling restart)."""
DETECT_S = 10.0
"""A silent partition is detected, and its streams moved, within this."""
KILLS = 3
"""SIGKILLs of the churn row, 10 s apart: each worker once."""
DNS_S = 12.0
"""The DNS server's outage: a dozen of the cluster's 1 s discovery rounds."""
CUT_S = 8.0
"""How long the prober is cut off: longer than its probe timeout, so it finds every worker unreachable."""
LOSS_S = 10.0
"""How long a worker's pod loses 5% of its packets."""


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
    load = {"streams": STREAMS, "tokens": TOKENS, "via_gateway": VIA_GATEWAY}
    row = asyncio.run(fault_row(cluster, "worker SIGKILL+restart", kill_and_restart, **load))
    report(row)
    assert row.offered >= STREAMS and row.admitted == row.offered and row.broken == 0, row.problems
    assert row.via_gateway >= VIA_GATEWAY
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


def test_a_worker_killed_every_10_s_keeps_the_callers_streaming_and_breaks_no_stream(cluster: Cluster) -> None:
    row = asyncio.run(churn_row(cluster, streams=STREAMS, tokens=TOKENS, kills=KILLS))
    report(row)
    assert row.offered >= STREAMS and row.admitted == row.offered and row.broken == 0, row.problems
    # Each restarted worker comes back at its full slots under the running prober and router: 16 callers fit on
    # the two others at every kill (one restarting worker at one slot would leave a caller or more waiting).
    assert len(row.streaming_at_faults) == KILLS
    assert min(row.streaming_at_faults) >= STREAMS - 2, row.streaming_at_faults
    assert row.moved > 0, "no generation ran on a killed worker"
    assert row.detect_s is not None and row.detect_s < DETECT_S
    assert row.recover_s is not None
    assert not row.strays and not row.rules


def test_the_dns_server_stopped_changes_nothing_discovery_keeps_what_it_had(cluster: Cluster) -> None:
    router_log = cluster.routers[0].log_path
    failures_before = router_log.read_text(errors="replace").count("lookup failed")
    row = asyncio.run(fault_row(cluster, f"DNS down {DNS_S:g} s", dns_outage(DNS_S), streams=STREAMS, tokens=TOKENS))
    report(row)
    assert router_log.read_text(errors="replace").count("lookup failed") > failures_before, "the outage was not seen"
    assert row.offered >= STREAMS and row.admitted == row.offered and row.broken == 0, row.problems
    assert row.detect_s is None and not row.others_lost, "a router stopped routing to a worker it had"
    assert row.moved == 0
    assert not row.strays and not row.rules


def test_a_prober_cut_from_the_workers_does_not_stop_the_router_routing(cluster: Cluster) -> None:
    fault = prober_cut("workers", CUT_S)
    row = asyncio.run(fault_row(cluster, "prober cut from workers", fault, streams=STREAMS, tokens=TOKENS))
    report(row)
    assert row.offered >= 2 * STREAMS and row.admitted == row.offered and row.broken == 0, row.problems
    # The router routed on its own health view: a generation begun during the cut (past the prober's probe
    # timeout) started at once, where following the prober's tables it waited for the heal (the client retrying).
    during = [t for t in row.traces if row.fault_at + 3 < t.started < row.heal_at - 1]
    assert during and max(t.arrivals[0] - t.started for t in during) < 1.0
    assert len(row.ended) == len(cluster.workers) and all(row.ended.values()), f"not spread: {row.ended}"
    assert row.moved == 0
    assert not row.strays and not row.rules


def test_a_router_cut_from_the_prober_keeps_routing_on_what_it_had(cluster: Cluster) -> None:
    fault = prober_cut("routers", CUT_S)
    row = asyncio.run(fault_row(cluster, "router cut from prober", fault, streams=STREAMS, tokens=TOKENS))
    report(row)
    assert row.offered >= 2 * STREAMS and row.admitted == row.offered and row.broken == 0, row.problems
    assert row.detect_s is None and not row.others_lost
    assert len(row.ended) == len(cluster.workers) and all(row.ended.values()), f"not spread: {row.ended}"
    assert row.moved == 0
    assert not row.strays and not row.rules


def test_five_percent_packet_loss_on_a_worker_breaks_no_stream(cluster: Cluster) -> None:
    fault = packet_loss(0.05, LOSS_S)
    row = asyncio.run(fault_row(cluster, "5% loss on a worker", fault, streams=STREAMS, tokens=TOKENS))
    report(row)
    assert row.offered >= 2 * STREAMS and row.admitted == row.offered and row.broken == 0, row.problems
    assert len(row.ended) == len(cluster.workers) and all(row.ended.values()), f"not spread: {row.ended}"
    assert not row.strays and not row.rules


def test_200_ms_added_between_router_and_a_worker_is_slower_not_failed(cluster: Cluster) -> None:
    row = asyncio.run(delay_row(cluster, delay_s=0.2, seconds=CUT_S, streams=STREAMS, tokens=TOKENS))
    report(row)
    assert row.offered >= STREAMS and row.admitted == row.offered and row.broken == 0, row.problems
    # The delayed worker is slower, not failed: still routed to (all its traffic through the proxy), none of its
    # generations moves.
    assert row.detect_s is None and row.victim_served
    assert row.moved == 0
    assert row.recover_s is not None
    assert not row.strays and not row.rules


def test_a_rolling_restart_of_workers_prober_and_gateway_under_load_breaks_no_stream(cluster: Cluster) -> None:
    row = asyncio.run(rolling_row(cluster, streams=STREAMS, tokens=TOKENS, via_gateway=VIA_GATEWAY))
    report(row)
    assert row.offered >= STREAMS and row.admitted == row.offered and row.broken == 0, row.problems
    assert row.via_gateway >= VIA_GATEWAY
    assert row.moved == 0, "a draining worker's generation moved: the drain did not let it finish"
    assert row.recover_s is not None
    assert not row.strays and not row.rules
