"""The prober's Prometheus metrics: each worker as it sees it, the table it decided, what each router acked."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from tokenmesh.prober._prober import Prober


class ProberMetrics:
    """Every metric of the prober, in its own registry."""

    registry: CollectorRegistry

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.tables = Counter("tokenmesh_prober_weight_tables_total", "Weight tables decided (each a new version)",
                              registry=self.registry)

    def watch(self, prober: Prober) -> None:
        """Report the workers, the table and the routers' acks at every scrape."""
        self.registry.register(_ProberCollector(prober))


class _ProberCollector(Collector):
    def __init__(self, prober: Prober) -> None:
        self._prober = prober

    def collect(self) -> Iterator[Metric]:
        p = self._prober
        weight = GaugeMetricFamily("tokenmesh_prober_worker_weight", "Weight in the table decided last",
                                   labels=["worker"])
        for w in p.table.workers:
            weight.add_metric([w.address], w.weight)
        up = GaugeMetricFamily("tokenmesh_prober_worker_up", "1 while the worker is reachable and SERVING",
                               labels=["worker"])
        rtt = GaugeMetricFamily("tokenmesh_prober_probe_rtt_seconds", "Round trip of the last stats ping",
                                labels=["worker"])
        for address, view in sorted(p.views.items()):
            up.add_metric([address], 1.0 if view.reachable and view.serving else 0.0)
            if view.rtt_s is not None:
                rtt.add_metric([address], view.rtt_s)
        acked = GaugeMetricFamily("tokenmesh_prober_router_acked_version", "Latest table version the router acked",
                                  labels=["router"])
        connected = GaugeMetricFamily("tokenmesh_prober_router_connected", "1 while the weight push stream is open",
                                      labels=["router"])
        for address, link in sorted(p.routers.items()):
            acked.add_metric([address], link.acked_version)
            connected.add_metric([address], 1.0 if link.connected else 0.0)
        yield from (weight, up, rtt, acked, connected)
        yield GaugeMetricFamily("tokenmesh_prober_weight_table_version", "Version of the table decided last",
                                value=p.table.version)
